package mcpserver

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"golang.org/x/net/netutil"
	"golang.org/x/sync/semaphore"

	"kiln/internal/config"
)

// Token is one accepted bearer token and the principal it names.
type Token struct {
	Principal string
	Secret    string
}

// LoadTokens reads tokens from the KILN_TOKEN value (one token) and from a
// file of lines "principal:token" or "token" ('#' comments). Like ssh with
// a private key, it refuses a file that its group or others may read or
// write: the tokens are the only thing between the network and the boxes.
func LoadTokens(envValue, file string) ([]Token, error) {
	var toks []Token
	add := func(line string) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			return
		}
		name, secret, ok := strings.Cut(line, ":")
		if !ok {
			secret = line
			sum := sha256.Sum256([]byte(secret))
			name = "token-" + hex.EncodeToString(sum[:4])
		}
		toks = append(toks, Token{Principal: strings.TrimSpace(name), Secret: strings.TrimSpace(secret)})
	}
	if envValue != "" {
		add(envValue)
	}
	if file != "" {
		f, err := config.OpenTrusted("token file", file, true)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			add(sc.Text())
		}
		if err := sc.Err(); err != nil {
			return nil, fmt.Errorf("reading token file: %w", err)
		}
	}
	for _, t := range toks {
		if len(t.Secret) < 16 {
			return nil, fmt.Errorf("token for %q is shorter than 16 characters", t.Principal)
		}
		// "local" is the stdio client's and unauthenticated loopback's
		// principal, and an empty one is taken for it (principalOf).
		if t.Principal == "" || t.Principal == localPrincipal {
			return nil, fmt.Errorf("a token names the principal %q, which is kiln's own for clients without a token: name another before its colon (name:token)", t.Principal)
		}
	}
	return toks, nil
}

// HTTPOptions configure the streamable HTTP endpoint.
type HTTPOptions struct {
	Tokens []Token     // empty: no authentication (loopback only; kiln serve checks with CheckListen)
	OAuth  *OAuth      // set: OAuth 2.1 access tokens instead of Tokens
	Limits *HTTPLimits // nil: DefaultHTTPLimits
}

// HTTPLimits bound what clients can hold on the HTTP listener. A zero
// field means no limit; DefaultHTTPLimits holds kiln serve's defaults.
//
// Timeouts. A request's headers must arrive within HeaderTimeout, the
// whole request, body included, within ReadTimeout, and a keep-alive
// connection is closed after IdleTimeout without a request. A response
// to a client that did not authenticate (a 401, /healthz, any other
// path) is written within WriteTimeout and closes its connection, and
// the request body of such a client is never read: an unauthenticated
// client costs a connection for as long as it takes to send headers.
//
// An authenticated /mcp response may last as long as a tool call (up to
// the call time limit, after waiting for the session's previous call)
// or, for an SSE stream, as long as its session. A deadline on the
// whole response would cut those, so for them WriteTimeout bounds each
// write instead: the deadline is pushed to now+WriteTimeout before every
// write and flush, which drops a client that stops reading without
// cutting a long call or a quiet stream. Likewise their read deadline is
// lifted once the body is in, since net/http cancels a request's context
// when a read deadline passes while its handler still runs.
type HTTPLimits struct {
	HeaderTimeout time.Duration
	ReadTimeout   time.Duration
	WriteTimeout  time.Duration
	IdleTimeout   time.Duration

	// MaxConns caps open connections; past it new connections wait in
	// the kernel's accept queue until one closes (netutil.LimitListener).
	// MaxConnsPerAddr caps the connections of one client address (one
	// IPv4 address, one IPv6 /64); past it they are closed at once. Turn
	// it off (0) behind a reverse proxy, where every client has its
	// address.
	MaxConns        int
	MaxConnsPerAddr int

	// MaxInflightBytes bounds the request bodies held at once, across all
	// requests, from admission to the end of the call. A request that
	// does not fit waits up to ReadTimeout, then gets 503. Bodies of at
	// most smallBody bytes are not counted: they are bounded by
	// MaxConns×smallBody, and ordinary calls never queue behind uploads.
	MaxInflightBytes int64

	// SessionIdle closes an MCP transport session (Mcp-Session-Id) that
	// has had no request for that long; MaxSessions caps the sessions of
	// one principal, closing its least recently used one to make room.
	// kiln never relies on a transport session (every result names the
	// kiln session it ran in), so a client whose session was closed
	// initializes again and carries on.
	SessionIdle time.Duration
	MaxSessions int
}

// DefaultHTTPLimits are the limits of kiln serve.
func DefaultHTTPLimits() HTTPLimits {
	return HTTPLimits{
		HeaderTimeout:    10 * time.Second,
		ReadTimeout:      60 * time.Second, // 16 MiB at 2.3 Mbit/s
		WriteTimeout:     30 * time.Second,
		IdleTimeout:      60 * time.Second,
		MaxConns:         512,
		MaxConnsPerAddr:  64,
		MaxInflightBytes: 32 << 20, // two bodies of the largest size
		SessionIdle:      30 * time.Minute,
		MaxSessions:      16,
	}
}

// smallBody is the size up to which a request body is not counted
// against MaxInflightBytes.
const smallBody = 64 << 10

func (o HTTPOptions) limits() HTTPLimits {
	if o.Limits == nil {
		return DefaultHTTPLimits()
	}
	return *o.Limits
}

// HTTPServer returns the http.Server of kiln serve: Handler with the
// timeouts of opts.Limits. Serve it on a listener from LimitListener.
func (s *Server) HTTPServer(addr string, opts HTTPOptions) *http.Server {
	lim := opts.limits()
	return &http.Server{
		Addr:              addr,
		Handler:           s.Handler(opts),
		ReadHeaderTimeout: lim.HeaderTimeout,
		ReadTimeout:       lim.ReadTimeout,
		WriteTimeout:      lim.WriteTimeout,
		IdleTimeout:       lim.IdleTimeout,
		MaxHeaderBytes:    64 << 10,
		// Clients can make net/http log at will (bad TLS, bad requests):
		// its messages are debug output.
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
}

// LimitListener applies the connection caps of lim to l.
func (s *Server) LimitListener(l net.Listener, lim HTTPLimits) net.Listener {
	if lim.MaxConnsPerAddr > 0 {
		l = &addrLimitListener{Listener: l, max: lim.MaxConnsPerAddr, open: map[string]int{}, log: s.log}
	}
	if lim.MaxConns > 0 {
		// Outside the per-address cap, so that connections it closes
		// never hold one of the MaxConns places.
		l = netutil.LimitListener(l, lim.MaxConns)
	}
	return l
}

// Handler serves MCP at /mcp for both protocol generations: sessionful
// clients (initialize, Mcp-Session-Id) go to a stateful handler; requests
// of the 2026-07-28 stateless revision (MCP-Protocol-Version header at or
// after it, no session header) go to a stateless one. The tools are the
// same; every result names its session, so nothing depends on a transport
// session existing.
func (s *Server) Handler(opts HTTPOptions) http.Handler {
	lim := opts.limits()
	get := func(*http.Request) *mcp.Server { return s.mcp }
	stateful := mcp.NewStreamableHTTPHandler(get, &mcp.StreamableHTTPOptions{Logger: s.log, MaxRequestBodyBytes: maxMessageBytes, SessionTimeout: lim.SessionIdle})
	stateless := mcp.NewStreamableHTTPHandler(get, &mcp.StreamableHTTPOptions{Stateless: true, JSONResponse: true, Logger: s.log, MaxRequestBodyBytes: maxMessageBytes})
	sessions := &sessionCap{mcp: s.mcp, max: lim.MaxSessions, byID: map[string]*capEntry{}, pending: map[string]int{}}
	var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Mcp-Session-Id") == "" && r.Header.Get("Mcp-Protocol-Version") >= "2026-07-28" {
			stateless.ServeHTTP(w, r)
			return
		}
		sessions.serve(w, r, stateful)
	})
	h = &admitted{next: h, lim: lim, budget: newBodyBudget(lim.MaxInflightBytes)}
	mux := http.NewServeMux()
	switch {
	case opts.OAuth != nil:
		h = opts.OAuth.middleware(h)
		opts.OAuth.register(mux)
	case len(opts.Tokens) > 0:
		h = auth.RequireBearerToken(verifier(opts.Tokens), nil)(h)
	}
	mux.Handle("/mcp", h)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Every response closes its connection unless admitted lifts it:
		// a client that did not authenticate keeps nothing open. Its body
		// is not read: net/http reads up to 256 KiB of an unread body
		// before answering on a connection it keeps, and before closing
		// one, which the expired read deadline cuts short.
		w.Header().Set("Connection", "close")
		mux.ServeHTTP(w, r)
		if w.Header().Get("Connection") == "close" {
			http.NewResponseController(w).SetReadDeadline(time.Now())
		}
	})
}

// admitted serves an authenticated request (any request when there are
// no tokens): it keeps the connection, bounds the bytes of bodies in
// flight and sets the deadlines described on HTTPLimits.
type admitted struct {
	next   http.Handler
	lim    HTTPLimits
	budget *bodyBudget
}

func (a *admitted) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	extend := func() {}
	if a.lim.WriteTimeout > 0 {
		dw := &deadlineWriter{ResponseWriter: w, rc: rc, d: a.lim.WriteTimeout}
		extend = dw.extend
		defer dw.extend() // for what net/http writes after the handler
		w = dw
	}
	if r.ContentLength > maxMessageBytes {
		http.Error(w, fmt.Sprintf("request body exceeds %d bytes", maxMessageBytes), http.StatusRequestEntityTooLarge)
		return
	}
	hasBody := r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0
	if hasBody {
		release, err := a.budget.acquire(r, a.lim.ReadTimeout)
		if err != nil {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "server busy: too many request bytes in flight, retry", http.StatusServiceUnavailable)
			return
		}
		defer release()
		// The wait may have used up the deadlines set with the headers.
		// Reading the body may write first (100 Continue).
		extend()
		if a.lim.ReadTimeout > 0 {
			rc.SetReadDeadline(time.Now().Add(a.lim.ReadTimeout))
		}
		r.Body = &onEOF{ReadCloser: r.Body, f: func() { rc.SetReadDeadline(time.Time{}) }}
	} else {
		rc.SetReadDeadline(time.Time{})
	}
	w.Header().Del("Connection")
	a.next.ServeHTTP(w, r)
}

// deadlineWriter pushes the write deadline forward before each write.
type deadlineWriter struct {
	http.ResponseWriter
	rc *http.ResponseController
	d  time.Duration
}

func (w *deadlineWriter) extend() { w.rc.SetWriteDeadline(time.Now().Add(w.d)) }

func (w *deadlineWriter) WriteHeader(code int) {
	w.extend()
	w.ResponseWriter.WriteHeader(code)
}

func (w *deadlineWriter) Write(p []byte) (int, error) {
	w.extend()
	return w.ResponseWriter.Write(p)
}

func (w *deadlineWriter) FlushError() error {
	w.extend()
	return w.rc.Flush()
}

func (w *deadlineWriter) Flush() { w.FlushError() }

func (w *deadlineWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// onEOF calls f once, when the body has been read to its end.
type onEOF struct {
	io.ReadCloser
	f    func()
	once sync.Once
}

func (b *onEOF) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.once.Do(b.f)
	}
	return n, err
}

// bodyBudget bounds the bytes of request bodies in flight. A request
// takes its whole declared length (the message limit when it declares
// none) before its body is read and gives it back when it is done, so no
// request holds part of the budget while waiting for more.
type bodyBudget struct {
	sem  *semaphore.Weighted // nil: no bound
	size int64
}

func newBodyBudget(size int64) *bodyBudget {
	if size <= 0 {
		return &bodyBudget{}
	}
	return &bodyBudget{sem: semaphore.NewWeighted(size), size: size}
}

func (b *bodyBudget) acquire(r *http.Request, wait time.Duration) (release func(), err error) {
	n := r.ContentLength
	if b.sem == nil || (n >= 0 && n <= smallBody) {
		return func() {}, nil
	}
	if n < 0 {
		n = maxMessageBytes
	}
	n = min(n, b.size)
	ctx := r.Context()
	if wait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, wait)
		defer cancel()
	}
	if err := b.sem.Acquire(ctx, n); err != nil {
		return nil, fmt.Errorf("waiting for %d bytes of request budget: %w", n, err)
	}
	return func() { b.sem.Release(n) }, nil
}

// sessionCap caps the MCP transport sessions of each principal. The SDK
// knows sessions but not whose they are, so sessionCap records the owner
// of each session it sees created and asks the SDK which are still open.
type sessionCap struct {
	mcp     *mcp.Server
	max     int // 0: no cap
	mu      sync.Mutex
	byID    map[string]*capEntry
	pending map[string]int // sessions being created, by principal
}

type capEntry struct {
	principal string
	last      time.Time
	busy      int // requests in flight
}

// ErrTooManySessions is the answer to an initialize past the cap when
// every session of the principal has a request in flight (an open
// standalone SSE stream does not count).
var ErrTooManySessions = errors.New("too many open MCP sessions for this principal; end one (DELETE /mcp) and retry")

func httpPrincipal(r *http.Request) string {
	if ti := auth.TokenInfoFromContext(r.Context()); ti != nil {
		return ti.UserID
	}
	return ""
}

func (c *sessionCap) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if c.max <= 0 {
		next.ServeHTTP(w, r)
		return
	}
	who := httpPrincipal(r)
	if sid := r.Header.Get("Mcp-Session-Id"); sid != "" {
		// A GET is the session's standalone SSE stream, which clients
		// of the official SDKs hold open for the session's life: it is
		// not work in flight, so it does not keep the session from
		// being closed to make room.
		defer c.use(sid, who, r.Method != http.MethodGet)()
		next.ServeHTTP(w, r)
		return
	}
	if r.Method != http.MethodPost {
		next.ServeHTTP(w, r)
		return
	}
	if err := c.makeRoom(who); err != nil {
		http.Error(w, err.Error(), http.StatusTooManyRequests)
		return
	}
	defer func() { c.created(w.Header().Get("Mcp-Session-Id"), who) }()
	next.ServeHTTP(w, r)
}

// use records a request of principal who in session sid and, if busy,
// marks the session busy until the request is done.
func (c *sessionCap) use(sid, who string, busy bool) (done func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.byID[sid]
	if e == nil || e.principal != who {
		return func() {}
	}
	e.last = time.Now()
	if !busy {
		return func() {}
	}
	e.busy++
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		e.busy--
		e.last = time.Now()
	}
}

// makeRoom reserves a place for a new session of who, closing who's least
// recently used idle sessions past the cap.
func (c *sessionCap) makeRoom(who string) error {
	c.mu.Lock()
	live := map[string]bool{}
	for ss := range c.mcp.Sessions() {
		live[ss.ID()] = true
	}
	var mine []string
	for id, e := range c.byID {
		switch {
		case !live[id]:
			delete(c.byID, id)
		case e.principal == who:
			mine = append(mine, id)
		}
	}
	var evict []string
	for n := len(mine) + c.pending[who]; n >= c.max; n-- {
		victim := ""
		for _, id := range mine {
			if e := c.byID[id]; e != nil && e.busy == 0 && (victim == "" || e.last.Before(c.byID[victim].last)) {
				victim = id
			}
		}
		if victim == "" {
			c.mu.Unlock()
			return ErrTooManySessions
		}
		delete(c.byID, victim)
		evict = append(evict, victim)
	}
	c.pending[who]++
	c.mu.Unlock()
	for ss := range c.mcp.Sessions() {
		if slices.Contains(evict, ss.ID()) {
			ss.Close()
		}
	}
	return nil
}

// created records the session sid (if one was made) and releases the
// place makeRoom reserved.
func (c *sessionCap) created(sid, who string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pending[who]--; c.pending[who] == 0 {
		delete(c.pending, who)
	}
	if sid != "" {
		c.byID[sid] = &capEntry{principal: who, last: time.Now()}
	}
}

// addrLimitListener closes connections past max from one client address.
type addrLimitListener struct {
	net.Listener
	max  int
	log  *slog.Logger
	mu   sync.Mutex
	open map[string]int
}

// clientKey is the address connections are counted under: the IP, or the
// /64 of an IPv6 address (one host often holds a whole /64).
func clientKey(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return a.String()
	}
	if ip4 := ta.IP.To4(); ip4 != nil {
		return ip4.String()
	}
	return ta.IP.Mask(net.CIDRMask(64, 128)).String()
}

func (l *addrLimitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		key := clientKey(c.RemoteAddr())
		l.mu.Lock()
		full := l.open[key] >= l.max
		if !full {
			l.open[key]++
		}
		l.mu.Unlock()
		if full {
			l.log.Debug("closing a connection past the per-address cap", "addr", key, "cap", l.max)
			c.Close()
			continue
		}
		return &addrConn{Conn: c, release: func() { l.release(key) }}, nil
	}
}

func (l *addrLimitListener) release(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[key]--; l.open[key] <= 0 {
		delete(l.open, key)
	}
}

type addrConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *addrConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

func verifier(toks []Token) auth.TokenVerifier {
	return func(ctx context.Context, token string, r *http.Request) (*auth.TokenInfo, error) {
		for _, t := range toks {
			if subtle.ConstantTimeCompare([]byte(token), []byte(t.Secret)) == 1 {
				return &auth.TokenInfo{UserID: t.Principal, Expiration: time.Now().Add(24 * time.Hour)}, nil
			}
		}
		return nil, auth.ErrInvalidToken
	}
}

// ErrNoToken refuses to expose kiln beyond loopback without a token.
var ErrNoToken = errors.New("refusing to listen on a non-loopback address without a token (set KILN_TOKEN or --token-file)")

// CheckListen refuses a non-loopback address when there are no tokens.
func CheckListen(addr string, toks []Token) error {
	loopback, err := isLoopback(addr)
	if err != nil {
		return err
	}
	if len(toks) == 0 && !loopback {
		return ErrNoToken
	}
	return nil
}

// isLoopback says whether addr (host:port) listens on loopback only.
func isLoopback(addr string) (bool, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false, fmt.Errorf("parsing address %q: %w", addr, err)
	}
	if host == "localhost" {
		return true, nil
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback(), nil
}

// Guard applies the rule of /mcp to another listener of kiln's, at addr:
// a non-loopback address without tokens is refused (ErrNoToken), and on a
// non-loopback address with tokens h answers only requests that bear one
// of them, as /mcp does. On loopback h is returned as it is: what may
// reach loopback is the host's own users, the same trust /mcp gives a
// loopback listener without tokens.
func Guard(addr string, toks []Token, h http.Handler) (http.Handler, error) {
	if err := CheckListen(addr, toks); err != nil {
		return nil, err
	}
	if loopback, _ := isLoopback(addr); loopback {
		return h, nil
	}
	return auth.RequireBearerToken(verifier(toks), nil)(h), nil
}
