package egress

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"kiln/internal/event"
	"kiln/internal/sandbox/boxkit"
)

// Sentinel errors of the package.
var (
	// ErrRefused is matched (errors.Is) by every *RefusedError.
	ErrRefused = errors.New("egress: refused by policy")
	// ErrUnsupported is returned on hosts where the gateway cannot run.
	ErrUnsupported = errors.New("egress: not supported on this OS")
	// ErrClosed is returned by Attach after the Gateway is closed.
	ErrClosed = errors.New("egress: gateway closed")
	// ErrPoolExhausted is returned by Attach when every box address in
	// Options.Network is in use.
	ErrPoolExhausted = errors.New("egress: no free box address in the gateway network")
)

// Options configure a Gateway. The zero value is usable; nil and zero
// fields mean the defaults.
type Options struct {
	Logger *slog.Logger
	// Observer is told of every attempt and its verdict (the audit log,
	// the metrics); nil: no one.
	Observer event.Observer

	// Network is the pool box addresses come from. It exists only inside
	// the gateway's own network namespace and the boxes' namespaces, never
	// on the host, so it need not be free on the host; it must hold three
	// gateway addresses plus one per concurrent box. Default 10.201.0.0/16.
	Network netip.Prefix

	// ProxyPort is the port of the HTTP CONNECT / plain-HTTP proxy that
	// HTTP_PROXY and HTTPS_PROXY point at. Default 3128.
	ProxyPort uint16

	// Listen, if set, makes a gateway for boxes that reach it over a real
	// network (Kubernetes Pods) rather than a veth of its own: no
	// namespace is made, the DNS responder (port 53, UDP and TCP) and the
	// HTTP proxy listen on this address of the caller's network
	// namespace, and boxes are attached by their address (AttachAddr).
	// What else a box reaches is the network's to deny (a NetworkPolicy
	// that lets it reach only these ports of this address); there is no
	// transparent proxy, so a box gets out only through its proxy
	// settings. Network is unused.
	Listen netip.Addr

	// Hosts maps names to addresses for the gateway's resolver, before
	// DNS; a name listed here is never looked up in DNS. For operators
	// with split-horizon DNS, and for tests. Merged over HostsFile.
	Hosts map[string][]netip.Addr
	// HostsFile is a file in /etc/hosts format read once by NewGateway,
	// with the same meaning as Hosts.
	HostsFile string
	// Resolver resolves names not in Hosts. Default net.DefaultResolver,
	// i.e. the host's own DNS configuration.
	Resolver *net.Resolver

	// TestOnlyAllowedAddrs — FOR TESTS ONLY, NEVER IN PRODUCTION.
	//
	// The gateway refuses to dial private, CGNAT, ULA, documentation and
	// benchmarking addresses even for allowed names. A test that builds
	// its own local "internet" in network namespaces needs addresses from
	// those ranges; listing them here lets the gateway dial exactly those
	// addresses. Prefixes outside those ranges are rejected by NewGateway:
	// loopback, link-local (the metadata service), multicast and the host's
	// own addresses can never be exempted. Empty by default.
	TestOnlyAllowedAddrs []netip.Prefix

	// Secrets are credentials the gateway adds to boxes' HTTPS requests
	// to their hosts, in place of placeholders (secrets.go).
	Secrets []Secret
	// UpstreamRoots are the roots a secret host's certificate is checked
	// against once the gateway has terminated the box's TLS. Default: the
	// host's.
	UpstreamRoots *x509.CertPool

	// DialTimeout bounds each dial to a destination. Default 10s.
	DialTimeout time.Duration
	// SniffTimeout bounds how long a box may take to send the request head
	// or TLS ClientHello that names its destination. Default 30s.
	SniffTimeout time.Duration
	// MaxRefusals is how many refusals an Attachment keeps between calls
	// to Refusals. Default 64.
	MaxRefusals int

	// MaxConnsPerBox caps the connections one box holds open to the
	// gateway's proxy and transparent listeners. Beyond it the box's new
	// connections are answered with a refusal and closed. Default 128.
	MaxConnsPerBox int
	// MaxConns caps the box connections of all boxes together, so no box
	// can exhaust the server's file descriptors. At the cap, a box that
	// holds less than its fair share (MaxConns divided by the attached
	// boxes) is still admitted, and the least recently active connection
	// of the box holding the most is closed to make room; a box at or
	// above its share is refused. So a box beyond its limits only ever
	// loses its own connections. Default 4096.
	MaxConns int
	// ConnIdleTimeout closes a box connection on which no byte moved in
	// either direction for this long. Default 5 minutes.
	ConnIdleTimeout time.Duration
	// ConnMaxLifetime closes a box connection this long after it was
	// accepted, busy or not. Default 1 hour.
	ConnMaxLifetime time.Duration
}

func (o Options) withDefaults() Options {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if !o.Network.IsValid() {
		o.Network = netip.MustParsePrefix("10.201.0.0/16")
	}
	if o.ProxyPort == 0 {
		o.ProxyPort = 3128
	}
	if o.DialTimeout == 0 {
		o.DialTimeout = 10 * time.Second
	}
	if o.SniffTimeout == 0 {
		o.SniffTimeout = 30 * time.Second
	}
	if o.MaxRefusals == 0 {
		o.MaxRefusals = 64
	}
	if o.MaxConnsPerBox == 0 {
		o.MaxConnsPerBox = 128
	}
	if o.MaxConns == 0 {
		o.MaxConns = 4096
	}
	if o.ConnIdleTimeout == 0 {
		o.ConnIdleTimeout = 5 * time.Minute
	}
	if o.ConnMaxLifetime == 0 {
		o.ConnMaxLifetime = time.Hour
	}
	return o
}

// BoxSetup is what a box under a policy gets from the gateway inside it:
// the same for every box under that policy, so a template can hold it
// before any box exists (the jail's zygote), and Attach gives each box
// the same in its Attachment.
type BoxSetup struct {
	ResolvConf  string   // the content of its /etc/resolv.conf
	Env         []string // for its processes: proxy settings, secrets' placeholders
	TrustBundle []byte   // the CA bundle it must trust (Attachment.TrustBundle); nil without secrets
}

// BoxInfo says whose box is being attached and what it may reach.
type BoxInfo struct {
	Session string
	Policy  Policy
}

// Refusal is one attempt the gateway refused.
type Refusal struct {
	Time   time.Time
	Via    string     // "dns", "http", "tls", "tcp" (transparent), "connect", "proxy" (HTTP_PROXY), "limit" (a connection closed to make room)
	Name   string     // the destination name the box asked for; empty if it named none
	Port   uint16     // the destination port; 0 for DNS
	Addr   netip.Addr // the refused resolved address, when that was the reason
	Reason string
}

// String tells the model plainly what happened.
func (r Refusal) String() string {
	switch {
	case r.Via == "limit":
		return "a connection through the egress gateway was closed: " + r.Reason
	case r.Name == "" && r.Port == 0:
		return "connection to the egress gateway refused: " + r.Reason
	case r.Via == "dns":
		return fmt.Sprintf("DNS lookup of %s refused by policy: %s", r.Name, r.Reason)
	case r.Name == "":
		return fmt.Sprintf("connection to port %d refused by policy: %s", r.Port, r.Reason)
	}
	return fmt.Sprintf("connection to %s refused by policy: %s", net.JoinHostPort(r.Name, strconv.Itoa(int(r.Port))), r.Reason)
}

// RefusedError is the error of a dial the policy refused.
type RefusedError struct{ Refusal Refusal }

func (e *RefusedError) Error() string        { return e.Refusal.String() }
func (e *RefusedError) Is(target error) bool { return target == ErrRefused }

// Attachment is one box's connection to the gateway. Close removes it.
type Attachment struct {
	session    string
	policy     Policy
	addr       netip.Addr
	resolvConf string
	env        []string
	hasSecrets bool // some host the policy allows has a secret
	core       *core
	proxy      *httputil.ReverseProxy
	transport  *http.Transport

	mu       sync.Mutex
	refusals []Refusal
	conns    map[io.Closer]struct{} // upstream connections
	cut      atomic.Bool            // set by Cut: nothing is allowed
	narrowed atomic.Pointer[Policy] // set by Restrict: what is left of policy
	closed   bool
	cleanup  boxkit.Cleanup

	// slots are the box's connections to the gateway's listeners, guarded
	// by core.lim.
	slots       map[*boxConn]struct{}
	slotsClosed bool
	logs        logLimiter // refusals and errors
	allowLogs   logLimiter // allowed attempts, apart: a flood of refusals must not hide one

	closeOnce sync.Once
	closeErr  error
}

// Session is the session the box belongs to.
func (a *Attachment) Session() string { return a.session }

// Policy is what the box may reach: the policy it was attached with, as
// Restrict has narrowed it.
func (a *Attachment) Policy() Policy {
	if p := a.narrowed.Load(); p != nil {
		return *p
	}
	return a.policy
}

// Addr is the box's address on its veth; invalid when the policy is empty
// and the box has loopback only.
func (a *Attachment) Addr() netip.Addr { return a.addr }

// ResolvConf is the content for the box's /etc/resolv.conf. Empty when the
// policy is empty.
func (a *Attachment) ResolvConf() string { return a.resolvConf }

// Env is the environment to add to the box's processes ("KEY=value"):
// HTTP_PROXY, HTTPS_PROXY and NO_PROXY in both cases. Empty when the policy
// is empty. Tools that ignore it still go through the transparent proxy.
func (a *Attachment) Env() []string { return append([]string(nil), a.env...) }

// Refusals returns the refusals since the last call, oldest first, and
// forgets them. A tool result can relay them to the model.
func (a *Attachment) Refusals() []Refusal {
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.refusals
	a.refusals = nil
	return r
}

func (a *Attachment) addRefusal(r Refusal) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if max := a.core.opts.MaxRefusals; len(a.refusals) >= max {
		a.refusals = append(a.refusals[:0], a.refusals[len(a.refusals)-max+1:]...)
	}
	a.refusals = append(a.refusals, r)
}

// track registers c to be closed with the attachment; false if it is
// already closed (and then c is closed).
func (a *Attachment) track(c io.Closer) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || a.cut.Load() {
		c.Close()
		return false
	}
	if a.conns == nil {
		a.conns = map[io.Closer]struct{}{}
	}
	a.conns[c] = struct{}{}
	return true
}

func (a *Attachment) untrack(c io.Closer) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.conns, c)
}

// onClose pushes a teardown step; Close runs them last-in first-out.
func (a *Attachment) onClose(f func() error) { a.cleanup.Add(f) }

// Close cuts the box off: it closes its connections, removes its veth,
// firewall rules and registration, and frees its address. It is safe to
// call twice.
func (a *Attachment) Close() error {
	a.closeOnce.Do(func() {
		a.mu.Lock()
		a.closed = true
		conns := a.conns
		a.conns = nil
		a.mu.Unlock()
		for c := range conns {
			c.Close()
		}
		if a.transport != nil {
			a.transport.CloseIdleConnections()
		}
		if a.core != nil {
			a.core.closeSlots(a)
			if n := a.logs.flush(); n > 0 {
				a.core.log.Warn("egress refusals not logged", "session", a.session, "count", n)
			}
			if n := a.allowLogs.flush(); n > 0 {
				a.core.log.Info("egress allowed attempts not logged", "session", a.session, "count", n)
			}
		}
		a.closeErr = a.cleanup.Run()
	})
	return a.closeErr
}

// core is the platform-independent part of the gateway: the registry of
// attached boxes, the policy checks, the DNS responder and the proxies.
type core struct {
	opts Options
	log  *slog.Logger
	res  *resolver
	chk  *addrChecker
	sec  *secrets // nil without secrets
	// bundle is trustBundle's answer, made once: every box of a gateway
	// with secrets gets the same, and boxes are made on a hot path.
	bundle func() []byte

	mu    sync.RWMutex
	boxes map[netip.Addr]*Attachment

	// lim guards the connection slots of every attachment and total, the
	// number held; taken before mu when both are.
	lim      sync.Mutex
	total    int
	refusing chan struct{} // one token per connection being refused
	http     *connQueue    // plain HTTP connections for the proxy's server
}

func newCore(opts Options) (*core, error) {
	res, err := newResolver(opts)
	if err != nil {
		return nil, err
	}
	chk, err := newAddrChecker(opts.TestOnlyAllowedAddrs)
	if err != nil {
		return nil, err
	}
	sec, err := newSecrets(opts.Secrets)
	if err != nil {
		return nil, err
	}
	c := &core{opts: opts, log: opts.Logger, res: res, chk: chk, sec: sec, boxes: map[netip.Addr]*Attachment{}, refusing: make(chan struct{}, maxRefusing)}
	c.bundle = sync.OnceValue(c.readTrustBundle)
	return c, nil
}

// newAttachment builds the attachment of a box at addr, with its own HTTP
// transport for the plain-HTTP proxy so connections are never shared
// between boxes.
func (c *core) newAttachment(box BoxInfo, addr netip.Addr) *Attachment {
	a := &Attachment{session: box.Session, policy: box.Policy, addr: addr, core: c}
	a.transport = &http.Transport{
		Proxy: nil, // never the host's proxy settings
		DialContext: func(ctx context.Context, _, hostport string) (net.Conn, error) {
			host, port, err := splitHostPort(hostport)
			if err != nil {
				return nil, err
			}
			via, _ := ctx.Value(viaKey{}).(string)
			return c.dial(ctx, a, cmp.Or(via, "proxy"), host, port)
		},
		TLSClientConfig:       &tls.Config{RootCAs: c.opts.UpstreamRoots, MinVersion: tls.VersionTLS12},
		DisableCompression:    true,
		MaxIdleConns:          8,
		MaxIdleConnsPerHost:   4,
		IdleConnTimeout:       30 * time.Second,
		ResponseHeaderTimeout: c.opts.ConnIdleTimeout,
	}
	a.proxy = &httputil.ReverseProxy{
		// The request goes out with the Host of its URL, the name the
		// policy checked: the handlers set the URL, and never a Host of
		// the box's choosing (domain fronting).
		Rewrite:        func(pr *httputil.ProxyRequest) { pr.Out.Host = "" },
		ModifyResponse: scrubResponse,
		Transport:      a.transport,
		ErrorLog:       slog.NewLogLogger(c.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			writeProxyError(w, err)
		},
	}
	return a
}

func (c *core) register(a *Attachment) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.boxes[a.addr] = a
}

func (c *core) unregister(a *Attachment) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.boxes[a.addr] == a {
		delete(c.boxes, a.addr)
	}
}

// boxAt returns the attachment whose box has the source address of addr.
func (c *core) boxAt(addr net.Addr) *Attachment {
	var ap netip.AddrPort
	switch v := addr.(type) {
	case *net.TCPAddr:
		ap = v.AddrPort()
	case *net.UDPAddr:
		ap = v.AddrPort()
	default:
		p, err := netip.ParseAddrPort(addr.String())
		if err != nil {
			return nil
		}
		ap = p
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.boxes[ap.Addr().Unmap()]
}

func (c *core) boxAtString(remote string) *Attachment {
	ap, err := netip.ParseAddrPort(remote)
	if err != nil {
		return nil
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.boxes[ap.Addr().Unmap()]
}

// refuse logs and records a refusal and returns it as an error. What the
// box chose (the name, and any of its bytes quoted in the reason) is
// bounded first.
func (c *core) refuse(a *Attachment, r Refusal) error {
	r.Time = time.Now()
	r.Name = clip(r.Name, maxNameLen)
	r.Reason = clip(r.Reason, maxReasonLen)
	attrs := []any{"session", a.session, "via", r.Via, "name", r.Name, "verdict", "refuse", "reason", r.Reason}
	if r.Port != 0 {
		attrs = append(attrs, "port", r.Port)
	}
	if r.Addr.IsValid() {
		attrs = append(attrs, "addr", r.Addr.String())
	}
	c.warnLimited(a, r.Time, "egress refused", attrs...)
	c.observe(a, r.Via, r.Name, r.Port, event.VerdictRefuse, r.Reason)
	a.addRefusal(r)
	return &RefusedError{Refusal: r}
}

// warnLimited logs a warning about box a unless a has used up its burst of
// log lines in this window; what it drops is summarized in one line when
// the window ends or the box is detached.
func (c *core) warnLimited(a *Attachment, now time.Time, msg string, attrs ...any) {
	ok, dropped := a.logs.allow(now)
	if dropped > 0 {
		c.log.Warn("egress refusals not logged", "session", a.session, "count", dropped, "window", logWindow.String())
	}
	if ok {
		c.log.Warn(msg, attrs...)
	}
}

// infoLimited logs an allowed attempt of box a, bounded as warnLimited
// bounds refusals, on a budget of its own.
func (c *core) infoLimited(a *Attachment, now time.Time, msg string, attrs ...any) {
	ok, dropped := a.allowLogs.allow(now)
	if dropped > 0 {
		c.log.Info("egress allowed attempts not logged", "session", a.session, "count", dropped, "window", logWindow.String())
	}
	if ok {
		c.log.Info(msg, attrs...)
	}
}

// dial checks name and port against the box's policy, resolves name on
// the host, checks every address it resolves to, and dials the first
// permitted one. The address dialed is the address checked, so a name that
// re-resolves differently (DNS rebinding) cannot slip past the check.
func (c *core) dial(ctx context.Context, a *Attachment, via, name string, port uint16) (net.Conn, error) {
	name = normalizeName(name)
	refusal := Refusal{Via: via, Name: name, Port: port}
	if len(name) > maxNameLen {
		refusal.Reason = fmt.Sprintf("the host name of %d bytes is longer than %d, the longest a DNS name can be", len(name), maxNameLen)
		return nil, c.refuse(a, refusal)
	}
	if _, err := netip.ParseAddr(name); err == nil {
		refusal.Reason = "connecting by IP address is not allowed; connect by an allowed host name"
		return nil, c.refuse(a, refusal)
	}
	if a.cut.Load() {
		refusal.Reason = reasonCut
		return nil, c.refuse(a, refusal)
	}
	if p := a.Policy(); !p.Allows(name, port) {
		refusal.Reason = "not in the allowlist (allowed: " + p.String() + ")"
		return nil, c.refuse(a, refusal)
	}
	ok, blocked, err := c.resolveChecked(ctx, name)
	if err != nil {
		c.warnLimited(a, time.Now(), "egress error", "session", a.session, "via", via, "name", name, "port", port, "verdict", "error", "err", err)
		c.observe(a, via, name, port, event.VerdictError, err.Error())
		return nil, err
	}
	if len(ok) == 0 {
		refusal.Addr = blocked[0].addr
		refusal.Reason = blockedReason(name, blocked)
		return nil, c.refuse(a, refusal)
	}
	d := net.Dialer{Timeout: c.opts.DialTimeout}
	var errs []error
	for _, addr := range ok {
		conn, err := d.DialContext(ctx, "tcp", netip.AddrPortFrom(addr, port).String())
		if err != nil {
			errs = append(errs, err)
			continue
		}
		c.infoLimited(a, time.Now(), "egress allowed", "session", a.session, "via", via, "name", name, "port", port, "addr", addr.String(), "verdict", "allow")
		c.observe(a, via, name, port, event.VerdictAllow, "")
		tc := &trackedConn{Conn: conn, att: a}
		if !a.track(tc) {
			return nil, ErrClosed
		}
		return tc, nil
	}
	err = fmt.Errorf("dialing %s port %d: %w", name, port, errors.Join(errs...))
	c.warnLimited(a, time.Now(), "egress error", "session", a.session, "via", via, "name", name, "port", port, "verdict", "error", "err", err)
	c.observe(a, via, name, port, event.VerdictError, err.Error())
	return nil, err
}

type blockedAddr struct {
	addr netip.Addr
	why  string
}

func blockedReason(name string, blocked []blockedAddr) string {
	parts := make([]string, len(blocked))
	for i, b := range blocked {
		parts[i] = b.addr.String() + " is " + b.why
	}
	return name + " resolves only to blocked addresses (" + strings.Join(parts, "; ") + ")"
}

// resolveChecked resolves name on the host and splits the result into
// addresses the gateway may dial and blocked ones.
func (c *core) resolveChecked(ctx context.Context, name string) (ok []netip.Addr, blocked []blockedAddr, err error) {
	addrs, err := c.res.lookup(ctx, name)
	if err != nil {
		return nil, nil, err
	}
	for _, addr := range addrs {
		if why := c.chk.check(addr); why != "" {
			blocked = append(blocked, blockedAddr{addr, why})
		} else {
			ok = append(ok, addr)
		}
	}
	if len(ok) == 0 && len(blocked) == 0 {
		return nil, nil, fmt.Errorf("resolving %s: no addresses", name)
	}
	return ok, blocked, nil
}

// trackedConn is an upstream connection that leaves its attachment's set
// when closed.
type trackedConn struct {
	net.Conn
	att  *Attachment
	once sync.Once
}

func (t *trackedConn) Close() error {
	t.once.Do(func() { t.att.untrack(t) })
	return t.Conn.Close()
}

func (t *trackedConn) CloseWrite() error {
	if cw, ok := t.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func splitHostPort(hostport string) (string, uint16, error) {
	host, p, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", 0, fmt.Errorf("parsing destination %q: %w", hostport, err)
	}
	port, err := strconv.ParseUint(p, 10, 16)
	if err != nil || port == 0 {
		return "", 0, fmt.Errorf("parsing destination %q: bad port", hostport)
	}
	return host, uint16(port), nil
}

// Describe says in one sentence what a box under p can reach, for tool
// descriptions.
func Describe(p Policy) string {
	if p.Empty() {
		return "The sandbox has no network access (loopback only)."
	}
	return "The sandbox can reach only these hosts over HTTP(S) (ports 80 and 443 unless a port is given): " +
		p.String() + ". Everything else, including raw IP connections, other UDP and ICMP, is refused."
}
