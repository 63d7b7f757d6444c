package egress

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
)

// A gateway with Options.Listen serves boxes that reach it over a network
// the gateway does not make: Kubernetes Pods, whose one way out (a
// NetworkPolicy) leads to the replica's address. It knows a box by the
// source address of what it asks, as every gateway does, and that address
// is the Pod's own: a Pod's code has no CAP_NET_RAW to forge another (the
// box container drops every capability but those its agent needs), and a
// TCP handshake to the proxy cannot complete from a forged one. A forged
// UDP query would only make the gateway answer, to the forged address,
// what that address's own box may resolve.

// errListening is an attach that needs a namespace, asked of a gateway
// that listens on an address.
var errListening = errors.New("egress: this gateway serves boxes on a network of its listen address; attach them by address (AttachAddr)")

// listenOn starts the DNS responder and the proxy on addr in the caller's
// network namespace.
func (g *Gateway) listenOn(addr netip.Addr) error {
	if !addr.Is4() || addr.IsUnspecified() || addr.IsLoopback() {
		return fmt.Errorf("egress: the listen address %v must be an IPv4 address the boxes reach (not loopback, not 0.0.0.0): it is also their resolver's", addr)
	}
	g.gwIP = addr
	a := addr.String()
	udp, err := net.ListenPacket("udp4", net.JoinHostPort(a, "53"))
	if err != nil {
		return fmt.Errorf("listening for the boxes' DNS on %s:53/udp: %w", a, err)
	}
	dnsTCP, err := net.Listen("tcp4", net.JoinHostPort(a, "53"))
	if err != nil {
		udp.Close()
		return fmt.Errorf("listening for the boxes' DNS on %s:53/tcp: %w", a, err)
	}
	proxyLn, err := net.Listen("tcp4", net.JoinHostPort(a, strconv.Itoa(int(g.opts.ProxyPort))))
	if err != nil {
		udp.Close()
		dnsTCP.Close()
		return fmt.Errorf("listening for the boxes' HTTP proxy on %s:%d: %w", a, g.opts.ProxyPort, err)
	}
	g.startDNS(udp, dnsTCP)
	g.startProxy(proxyLn)
	return nil
}

// Listening reports whether the gateway serves boxes on a network of its
// listen address (Options.Listen) rather than through veths of its own.
func (g *Gateway) Listening() bool { return g.opts.Listen.IsValid() }

// ProxyPort is the port of the gateway's HTTP proxy.
func (g *Gateway) ProxyPort() uint16 { return g.opts.ProxyPort }

// AttachAddr attaches the box at addr, the address its traffic comes from
// on the network the gateway listens on, with box.Policy. The caller must
// have made sure that addr is that box's alone for as long as the
// attachment lives (a running Pod's IP) and that the box reaches nothing
// but the gateway's ports; the Attachment's ResolvConf and Env are what
// the box must be given. An address attached again is the new box's: the
// earlier attachment stays, and answers nothing.
//
// With an empty policy nothing is attached.
func (g *Gateway) AttachAddr(addr netip.Addr, box BoxInfo) (*Attachment, error) {
	if box.Policy.Empty() {
		return &Attachment{session: box.Session, core: g.c}, nil
	}
	if !g.opts.Listen.IsValid() {
		return nil, errors.New("egress: AttachAddr needs a gateway with a listen address (Options.Listen)")
	}
	addr = addr.Unmap()
	if !addr.Is4() || addr.IsUnspecified() || addr.IsLoopback() || addr == g.gwIP {
		return nil, fmt.Errorf("egress: %v cannot be a box's address", addr)
	}
	a := g.c.newAttachment(box, addr)
	if err := g.enlist(a, box); err != nil {
		return nil, err
	}
	return a, nil
}
