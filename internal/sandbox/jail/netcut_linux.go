package jail

import "kiln/internal/sandbox"

var _ sandbox.NetworkCutter = (*jailBox)(nil)

// CutNetwork makes the egress gateway refuse everything the box asks
// from now on and closes its open connections. The box's own network
// namespace has no other way out, so nothing else is needed.
func (j *jailBox) CutNetwork() error {
	if j.egress != nil {
		j.egress.Cut()
	}
	return nil
}
