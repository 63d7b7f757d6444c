package egress

import "io"

// reasonCut is the refusal of everything a box asks once it is cut off.
const reasonCut = "this box has no network: the client it runs for is not allowed to use it"

// Cut takes the network from the box for good, whatever its policy: its
// open upstream connections are closed, and every later lookup and
// connection is refused. The session layer cuts the boxes of clients that
// may not use the network (kiln serve --auth oidc without the network
// scope). The box keeps its attachment, so it is still destroyed the
// same way, and its refusals still reach the model.
func (a *Attachment) Cut() {
	if a.cut.Swap(true) {
		return
	}
	a.closeUpstream()
}

// Restrict narrows what the box may reach, for good, to what both its
// policy and p allow (Policy.Narrow): a per-principal allowlist applied to
// a box made under the server's. It never widens: a second call narrows
// what the first left. When that changes anything, the box's open
// upstream connections are closed, so none made under the wider policy
// outlives it.
func (a *Attachment) Restrict(p Policy) {
	for {
		old := a.narrowed.Load()
		cur := a.Policy()
		next := cur.Narrow(p)
		if next.Equal(cur) {
			return
		}
		if a.narrowed.CompareAndSwap(old, &next) {
			break
		}
	}
	a.closeUpstream()
}

// closeUpstream closes the box's open upstream connections.
func (a *Attachment) closeUpstream() {
	a.mu.Lock()
	conns := make([]io.Closer, 0, len(a.conns))
	for c := range a.conns {
		conns = append(conns, c)
	}
	a.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
	if a.transport != nil {
		a.transport.CloseIdleConnections()
	}
}

// IsCut reports whether Cut was called.
func (a *Attachment) IsCut() bool { return a.cut.Load() }

// The methods below are what a box behind the gateway answers for
// sandbox.RefusalReporter and sandbox.NetworkCutter: every backend's box
// hands them to its attachment. A nil attachment (a box without a
// network) has nothing to report, cut or narrow.

// NetworkRefusals says which connections the policy refused since the
// last call, in words for the model.
func (a *Attachment) NetworkRefusals() []string {
	if a == nil {
		return nil
	}
	var out []string
	for _, r := range a.Refusals() {
		out = append(out, r.String())
	}
	return out
}

// CutNetwork is Cut. The box must have no way out but the gateway, which
// every backend that attaches boxes makes sure of.
func (a *Attachment) CutNetwork() error {
	if a != nil {
		a.Cut()
	}
	return nil
}

// RestrictNetwork is Restrict to the policy of hosts.
func (a *Attachment) RestrictNetwork(hosts []string) error {
	if a == nil {
		return nil
	}
	p, err := ParsePolicy(hosts...)
	if err != nil {
		return err
	}
	a.Restrict(p)
	return nil
}
