//go:build linux

package egress

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"kiln/internal/netnsrun"
	"kiln/internal/sandbox/boxkit"
)

// Table names of the firewall rules the gateway installs.
const (
	gatewayTable = "kiln_gateway"
	boxTable     = "kiln_egress"
	// boxVethPrefix names the gateway's end of every box's veth, which
	// the gateway's firewall matches boxes by.
	boxVethPrefix = "kb"
)

// Gateway is kiln's egress gateway: a network namespace of its own, holding
// the DNS responder, the transparent proxy and the HTTP proxy, to which each
// attached box is wired by one veth pair. See the package documentation.
type Gateway struct {
	c       *core
	opts    Options
	ns      netns.NsHandle
	nl      *netlink.Handle
	gwIP    netip.Addr // DNS and HTTP proxy
	transIP netip.Addr // transparent listeners; the boxes' DNAT target
	first   netip.Addr // first box address
	size    int        // box addresses in the pool

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu          sync.Mutex
	closed      bool
	used        map[int]bool
	next        int
	transparent map[uint16]net.Listener
	attached    map[*Attachment]struct{}
	cleanup     boxkit.Cleanup
}

// NewGateway creates the gateway's network namespace, its firewall and its
// listeners. It needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root).
func NewGateway(opts Options) (_ *Gateway, err error) {
	opts = opts.withDefaults()
	netw := opts.Network.Masked()
	if !netw.Addr().Is4() || netw.Bits() > 29 {
		return nil, fmt.Errorf("checking gateway network %v: must be an IPv4 prefix of /29 or wider", opts.Network)
	}
	c, err := newCore(opts)
	if err != nil {
		return nil, err
	}
	base := netw.Addr()
	g := &Gateway{
		c: c, opts: opts,
		gwIP:        base.Next(),
		transIP:     base.Next().Next(),
		first:       base.Next().Next().Next(),
		size:        1<<(32-netw.Bits()) - 4, // network, gateway, transparent, broadcast
		used:        map[int]bool{},
		transparent: map[uint16]net.Listener{},
		attached:    map[*Attachment]struct{}{},
	}
	g.ctx, g.cancel = context.WithCancel(context.Background())
	defer func() {
		if err != nil {
			g.Close()
		}
	}()
	if opts.Listen.IsValid() {
		return g, g.listenOn(opts.Listen)
	}
	if err := g.makeNamespace(); err != nil {
		return nil, err
	}
	if err := installTable(g.ns, gatewayTable, gatewayChains(g.gwIP, g.transIP, opts.ProxyPort)); err != nil {
		return nil, err
	}
	var udp net.PacketConn
	var dnsTCP, proxyLn net.Listener
	err = netnsrun.In(g.ns, func() error {
		var err error
		gw := g.gwIP.String()
		if udp, err = net.ListenPacket("udp4", net.JoinHostPort(gw, "53")); err != nil {
			return fmt.Errorf("listening for DNS over UDP: %w", err)
		}
		if dnsTCP, err = net.Listen("tcp4", net.JoinHostPort(gw, "53")); err != nil {
			udp.Close()
			return fmt.Errorf("listening for DNS over TCP: %w", err)
		}
		if proxyLn, err = net.Listen("tcp4", net.JoinHostPort(gw, strconv.Itoa(int(opts.ProxyPort)))); err != nil {
			udp.Close()
			dnsTCP.Close()
			return fmt.Errorf("listening for the HTTP proxy: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	g.startDNS(udp, dnsTCP)
	g.startProxy(proxyLn)
	return g, nil
}

// makeNamespace creates the gateway's network namespace with its two
// addresses on loopback, no forwarding, strict reverse-path filtering and
// no IPv6.
func (g *Gateway) makeNamespace() error {
	ns, err := netnsrun.New()
	if err != nil {
		return err
	}
	g.ns = ns
	g.onClose(func() error { return ns.Close() })
	nl, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("opening netlink in gateway namespace: %w", err)
	}
	g.nl = nl
	g.onClose(func() error { nl.Close(); return nil })

	lo, err := nl.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding gateway loopback: %w", err)
	}
	for _, a := range []netip.Addr{g.gwIP, g.transIP} {
		if err := nl.AddrAdd(lo, &netlink.Addr{IPNet: hostNet(a)}); err != nil {
			return fmt.Errorf("adding gateway address %v: %w", a, err)
		}
	}
	if err := nl.LinkSetUp(lo); err != nil {
		return fmt.Errorf("bringing up gateway loopback: %w", err)
	}
	err = netnsrun.In(ns, func() error {
		for _, s := range [][2]string{
			{"net/ipv4/ip_forward", "0"},
			// Strict reverse-path filtering: a box cannot pass for another
			// by forging its source address.
			{"net/ipv4/conf/all/rp_filter", "1"},
			{"net/ipv4/conf/default/rp_filter", "1"},
			{"net/ipv6/conf/all/disable_ipv6", "1"},
			{"net/ipv6/conf/default/disable_ipv6", "1"},
		} {
			if err := writeSysctl(s[0], s[1]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("configuring gateway namespace: %w", err)
	}
	return nil
}

// startDNS serves the DNS responder on udp and tcp, and returns once both
// servers have started.
func (g *Gateway) startDNS(udp net.PacketConn, tcp net.Listener) {
	c := g.c
	handler := dns.HandlerFunc(c.serveDNS)
	for _, srv := range []*dns.Server{
		{PacketConn: udp, Handler: handler},
		{Listener: limitListener{tcp, c, "dns"}, Handler: handler, ReadTimeout: g.opts.SniffTimeout},
	} {
		started := make(chan struct{})
		srv.NotifyStartedFunc = func() { close(started) }
		g.wg.Go(func() {
			if err := srv.ActivateAndServe(); err != nil {
				c.log.Error("egress DNS server stopped", "err", err)
			}
		})
		<-started
		g.onClose(func() error { return srv.Shutdown() })
	}
}

// startProxy serves the HTTP proxy on ln.
//
// One HTTP server serves the proxy port and the plain HTTP connections
// handed over from the transparent listeners and CONNECT tunnels. Box
// connections are admitted against the connection limits as they are
// accepted (limitListener, acceptLoop), and carry the idle and lifetime
// limits themselves (boxConn).
func (g *Gateway) startProxy(ln net.Listener) {
	c, opts := g.c, g.opts
	c.http = newConnQueue(ln.Addr())
	proxy := &http.Server{
		Handler:           c.proxyHandler(),
		ReadHeaderTimeout: opts.SniffTimeout,
		IdleTimeout:       min(proxyIdleTimeout, opts.ConnIdleTimeout),
		MaxHeaderBytes:    maxHTTPHeader,
		ConnContext:       connContext,
		ErrorLog:          slog.NewLogLogger(c.log.Handler(), slog.LevelDebug),
	}
	for _, ln := range []net.Listener{limitListener{ln, c, "proxy"}, c.http} {
		g.wg.Go(func() {
			if err := proxy.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				c.log.Error("egress proxy stopped", "err", err)
			}
		})
	}
	g.onClose(func() error { return proxy.Close() })
}

func hostNet(a netip.Addr) *net.IPNet {
	return &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}
}

func (g *Gateway) onClose(f func() error) { g.cleanup.Add(f) }

// Close detaches every box, stops the listeners and removes the gateway's
// namespace. It is safe to call twice.
func (g *Gateway) Close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil
	}
	g.closed = true
	atts := make([]*Attachment, 0, len(g.attached))
	for a := range g.attached {
		atts = append(atts, a)
	}
	g.mu.Unlock()

	var errs []error
	for _, a := range atts {
		errs = append(errs, a.Close())
	}
	g.cancel()
	errs = append(errs, g.cleanup.Run())
	g.wg.Wait()
	return errors.Join(errs...)
}

// GatewayAddr is the address of the gateway's DNS responder and HTTP proxy
// as boxes see it.
func (g *Gateway) GatewayAddr() netip.Addr { return g.gwIP }

// BoxSetup is what a box under p gets.
func (g *Gateway) BoxSetup(p Policy) BoxSetup {
	proxy := proxyURL(g.gwIP.String(), g.opts.ProxyPort)
	noProxy := "localhost,127.0.0.1,::1"
	s := BoxSetup{
		ResolvConf: "# kiln egress gateway: answers only names the policy allows\nnameserver " + g.gwIP.String() + "\noptions attempts:2 timeout:2\n",
		Env: []string{
			"HTTP_PROXY=" + proxy, "HTTPS_PROXY=" + proxy, "NO_PROXY=" + noProxy,
			"http_proxy=" + proxy, "https_proxy=" + proxy, "no_proxy=" + noProxy,
		},
	}
	if env := g.c.sec.envFor(p); len(env) > 0 {
		s.Env = append(s.Env, env...)
		s.TrustBundle = g.c.trustBundle()
	}
	return s
}

// Attach wires the box whose process is pid to the gateway with box.Policy.
// Call it after the box's process has created its network namespace and
// before the box runs any code. It moves one end of a new veth pair into
// that namespace as eth0, addresses it, routes everything to the gateway,
// and installs the box's firewall (nftables table "kiln_egress"). The
// Attachment's ResolvConf and Env are what the box must be given.
//
// With an empty policy Attach touches nothing and returns an Attachment
// with empty ResolvConf and Env: the box keeps loopback only.
func (g *Gateway) Attach(ctx context.Context, pid int, box BoxInfo) (*Attachment, error) {
	if box.Policy.Empty() {
		return &Attachment{session: box.Session, core: g.c}, nil
	}
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		return nil, fmt.Errorf("opening network namespace of pid %d: %w", pid, err)
	}
	return g.attachNS(ctx, ns, box)
}

// attachNS is Attach for a namespace handle, which it takes over.
func (g *Gateway) attachNS(ctx context.Context, ns netns.NsHandle, box BoxInfo) (_ *Attachment, err error) {
	if g.opts.Listen.IsValid() {
		ns.Close()
		return nil, errListening
	}
	idx, addr, err := g.allocate()
	if err != nil {
		ns.Close()
		return nil, err
	}
	a := g.c.newAttachment(box, addr)
	a.onClose(func() error { return ns.Close() })
	a.onClose(func() error { g.release(idx); return nil })
	defer func() {
		if err != nil {
			a.Close()
		}
	}()
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	// The gateway's end lives in the gateway namespace, so its name only
	// needs to be unique there; the box's end is created directly in the
	// box's namespace as eth0.
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: boxVethPrefix + strconv.Itoa(idx)},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(int(ns)),
	}
	if err := g.nl.LinkAdd(veth); err != nil {
		return nil, fmt.Errorf("creating veth pair: %w", err)
	}
	a.onClose(func() error {
		if err := g.nl.LinkDel(veth); err != nil {
			return fmt.Errorf("deleting veth %s: %w", veth.Name, err)
		}
		return nil
	})
	gwEnd, err := g.nl.LinkByName(veth.Name)
	if err != nil {
		return nil, fmt.Errorf("finding veth %s: %w", veth.Name, err)
	}
	if err := g.nl.LinkSetUp(gwEnd); err != nil {
		return nil, fmt.Errorf("bringing up veth %s: %w", veth.Name, err)
	}
	if err := g.nl.RouteAdd(&netlink.Route{LinkIndex: gwEnd.Attrs().Index, Dst: hostNet(addr), Scope: netlink.SCOPE_LINK}); err != nil {
		return nil, fmt.Errorf("routing box address %v: %w", addr, err)
	}

	if err := g.configureBox(ns, addr); err != nil {
		return nil, err
	}
	if err := installTable(ns, boxTable, boxChains(g.gwIP, g.transIP, g.opts.ProxyPort, box.Policy.Ports())); err != nil {
		return nil, fmt.Errorf("installing box firewall: %w", err)
	}
	a.onClose(func() error {
		// The namespace is still held open by this attachment, so the
		// table is there unless someone inside removed it.
		if err := deleteTable(ns, boxTable); err != nil && !errors.Is(err, unix.ENOENT) {
			return err
		}
		return nil
	})
	if err := g.listenTransparent(box.Policy.Ports()); err != nil {
		return nil, err
	}

	if err := g.enlist(a, box); err != nil {
		return nil, err
	}
	return a, nil
}

// enlist gives a, a new attachment of box's at its address, what the box
// must be given, and registers it: from now on the gateway serves what
// comes from that address under box's policy, until a closes.
func (g *Gateway) enlist(a *Attachment, box BoxInfo) error {
	setup := g.BoxSetup(box.Policy)
	a.resolvConf, a.env, a.hasSecrets = setup.ResolvConf, setup.Env, setup.TrustBundle != nil
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return ErrClosed
	}
	g.attached[a] = struct{}{}
	g.mu.Unlock()
	a.onClose(func() error {
		g.mu.Lock()
		delete(g.attached, a)
		g.mu.Unlock()
		return nil
	})
	g.c.register(a)
	a.onClose(func() error { g.c.unregister(a); return nil })
	g.c.log.Info("egress attached", "session", box.Session, "addr", a.addr.String(), "policy", box.Policy.String())
	return nil
}

// configureBox addresses the box's eth0 and routes everything through the
// gateway. The box gets a /32 and on-link routes to the two gateway
// addresses, so boxes never share a subnet.
func (g *Gateway) configureBox(ns netns.NsHandle, addr netip.Addr) error {
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("opening netlink in box namespace: %w", err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding box loopback: %w", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		return fmt.Errorf("bringing up box loopback: %w", err)
	}
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("finding box eth0: %w", err)
	}
	if err := netnsrun.In(ns, func() error { return writeSysctl("net/ipv6/conf/eth0/disable_ipv6", "1") }); err != nil {
		return fmt.Errorf("configuring box namespace: %w", err)
	}
	if err := h.AddrAdd(eth, &netlink.Addr{IPNet: hostNet(addr)}); err != nil {
		return fmt.Errorf("addressing box eth0: %w", err)
	}
	if err := h.LinkSetUp(eth); err != nil {
		return fmt.Errorf("bringing up box eth0: %w", err)
	}
	for _, a := range []netip.Addr{g.gwIP, g.transIP} {
		if err := h.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Dst: hostNet(a), Scope: netlink.SCOPE_LINK}); err != nil {
			return fmt.Errorf("routing to gateway address %v: %w", a, err)
		}
	}
	if err := h.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: g.gwIP.AsSlice()}); err != nil {
		return fmt.Errorf("adding box default route: %w", err)
	}
	return nil
}

// allocate takes a free box address, preferring ones not used recently.
func (g *Gateway) allocate() (int, netip.Addr, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return 0, netip.Addr{}, ErrClosed
	}
	for range g.size {
		i := g.next
		g.next = (g.next + 1) % g.size
		if !g.used[i] {
			g.used[i] = true
			a := g.first
			for range i {
				a = a.Next()
			}
			return i, a, nil
		}
	}
	return 0, netip.Addr{}, ErrPoolExhausted
}

func (g *Gateway) release(i int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.used, i)
}

// listenTransparent makes sure a transparent listener serves each port.
// Listeners stay until the gateway closes; a box reaches only the ports
// its own firewall lets through, and the proxy checks its policy anyway.
func (g *Gateway) listenTransparent(ports []uint16) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, p := range ports {
		if _, ok := g.transparent[p]; ok {
			continue
		}
		var ln net.Listener
		err := netnsrun.In(g.ns, func() error {
			var err error
			ln, err = net.Listen("tcp4", net.JoinHostPort(g.transIP.String(), strconv.Itoa(int(p))))
			return err
		})
		if err != nil {
			return fmt.Errorf("listening on transparent port %d: %w", p, err)
		}
		g.transparent[p] = ln
		g.onClose(ln.Close)
		g.wg.Go(func() { g.acceptLoop(ln, p) })
	}
	return nil
}

func (g *Gateway) acceptLoop(ln net.Listener, port uint16) {
	for {
		conn, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			g.c.log.Warn("egress accept", "port", port, "err", err)
			select {
			case <-g.ctx.Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		go func() {
			if b := g.c.admit(conn, "tcp", port); b != nil {
				g.c.serveTransparent(g.ctx, b, port)
			}
		}()
	}
}
