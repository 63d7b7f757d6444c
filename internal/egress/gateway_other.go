//go:build !linux

package egress

import (
	"context"
	"net/netip"
)

// Gateway is kiln's egress gateway. It needs Linux network namespaces; on
// other systems NewGateway returns ErrUnsupported.
type Gateway struct{}

// NewGateway returns ErrUnsupported on this OS.
func NewGateway(opts Options) (*Gateway, error) { return nil, ErrUnsupported }

// Close does nothing on this OS.
func (g *Gateway) Close() error { return nil }

// GatewayAddr returns the zero address on this OS.
func (g *Gateway) GatewayAddr() netip.Addr { return netip.Addr{} }

// Attach returns ErrUnsupported on this OS, except for an empty policy,
// which needs no network at all.
func (g *Gateway) Attach(ctx context.Context, pid int, box BoxInfo) (*Attachment, error) {
	if box.Policy.Empty() {
		return &Attachment{session: box.Session}, nil
	}
	return nil, ErrUnsupported
}

// AttachAddr returns ErrUnsupported on this OS, except for an empty
// policy.
func (g *Gateway) AttachAddr(addr netip.Addr, box BoxInfo) (*Attachment, error) {
	if box.Policy.Empty() {
		return &Attachment{session: box.Session}, nil
	}
	return nil, ErrUnsupported
}

// Listening reports false on this OS.
func (g *Gateway) Listening() bool { return false }

// ProxyPort returns 0 on this OS.
func (g *Gateway) ProxyPort() uint16 { return 0 }

// BoxSetup is empty on this OS.
func (g *Gateway) BoxSetup(p Policy) BoxSetup { return BoxSetup{} }
