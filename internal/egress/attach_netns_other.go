//go:build !linux

package egress

import "context"

// AttachNetNS returns ErrUnsupported on this OS, except for an empty
// policy, which needs no network at all.
func (g *Gateway) AttachNetNS(ctx context.Context, box BoxInfo) (*Attachment, string, error) {
	if box.Policy.Empty() {
		return &Attachment{session: box.Session}, "", nil
	}
	return nil, "", ErrUnsupported
}
