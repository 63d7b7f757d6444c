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
