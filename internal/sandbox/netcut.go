package sandbox

// NetworkCutter is implemented by boxes that may have network access (an
// egress allowlist) and can lose it for good while they run. The session
// layer cuts a box before any call of a client that may not use the
// network runs in it, so such a call never sees a box with network, even
// one a permitted call of the same principal used before. A box with no
// network returns nil. A backend whose boxes can have network must
// implement it: the session layer takes a box without it to have none.
type NetworkCutter interface {
	CutNetwork() error
	// RestrictNetwork narrows the box's allowlist, for good, to what both
	// it and hosts allow (egress policy entries, as --allow-net takes
	// them): the operator's allowlist for the principal the box serves.
	// It never widens; a box with no network returns nil.
	RestrictNetwork(hosts []string) error
}
