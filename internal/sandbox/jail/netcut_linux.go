package jail

import "kiln/internal/sandbox"

var _ sandbox.NetworkCutter = (*jailBox)(nil)

// CutNetwork makes the egress gateway refuse everything the box asks
// from now on and closes its open connections. The box's own network
// namespace has no other way out, so nothing else is needed.
func (j *jailBox) CutNetwork() error { return j.egress.CutNetwork() }

// RestrictNetwork narrows what the gateway lets the box reach.
func (j *jailBox) RestrictNetwork(hosts []string) error { return j.egress.RestrictNetwork(hosts) }
