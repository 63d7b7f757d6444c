package mcpserver_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// The tests in this file attack the HTTP listener the way the second
// hardening pass did, on loopback only and bounded in count and time, and
// show a legitimate client being served during each attack. They assert
// on outcomes and on the order of events, never on how fast a thing was.

const initBody = `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`

type httpFixture struct {
	srv    *mcpserver.Server
	addr   string // host:port
	secret string
}

// startHTTP serves a kiln server without a backend (initialize and ping
// need none) on 127.0.0.1, the way kiln serve does, with lim.
func startHTTP(t *testing.T, lim mcpserver.HTTPLimits) *httpFixture {
	t.Helper()
	mgr := session.NewManager(session.Options{Backend: nil, PoolSize: 0})
	t.Cleanup(mgr.Close)
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: "none"})
	return serveHTTP(t, srv, lim)
}

func serveHTTP(t *testing.T, srv *mcpserver.Server, lim mcpserver.HTTPLimits) *httpFixture {
	t.Helper()
	f := &httpFixture{srv: srv, secret: strings.Repeat("s", 32)}
	opts := mcpserver.HTTPOptions{
		Tokens: []mcpserver.Token{{Principal: "alice", Secret: f.secret}, {Principal: "bob", Secret: strings.Repeat("b", 32)}},
		Limits: &lim,
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.addr = ln.Addr().String()
	hs := srv.HTTPServer(f.addr, opts)
	go hs.Serve(srv.LimitListener(ln, lim))
	t.Cleanup(func() { hs.Close() })
	return f
}

// testLimits are small limits for tests; each test changes what it probes.
func testLimits() mcpserver.HTTPLimits {
	lim := mcpserver.DefaultHTTPLimits()
	lim.MaxConns = 64
	lim.MaxConnsPerAddr = 8
	return lim
}

// dialFrom opens a TCP connection to addr from the loopback address src
// (any 127.0.0.0/8 address is local on Linux), so one test can be many
// clients.
func dialFrom(src, addr string) (net.Conn, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	return d.Dial("tcp", addr)
}

// legit is a well-behaved authenticated client at src: it initializes
// and must get 200 within a generous bound. It returns the latency.
func (f *httpFixture) legit(t *testing.T, src string) time.Duration {
	t.Helper()
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return dialFrom(src, addr)
		},
		DisableKeepAlives: true,
	}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 15 * time.Second}
	req, _ := http.NewRequest("POST", "http://"+f.addr+"/mcp", strings.NewReader(initBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "Bearer "+f.secret)
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("legitimate client at %s: %v", src, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("legitimate client at %s: status %d", src, resp.StatusCode)
	}
	return time.Since(start)
}

// waitClosed reports whether the server closed c (EOF or reset) before
// the deadline; any bytes sent before the close are read and dropped.
func waitClosed(c net.Conn, within time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(within))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return false
	}
	return true
}

// countClosed waits, in parallel, for the server to close each of conns
// and returns how many it closed within the bound.
func countClosed(conns []net.Conn, within time.Duration) int {
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		closed int
	)
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if waitClosed(c, within) {
				mu.Lock()
				closed++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return closed
}

// TestHTTPUnauthenticatedBodyNotRead: a POST without a token that
// trickles its body gets its 401 at once and the connection is closed;
// the body is never waited for.
func TestHTTPUnauthenticatedBodyNotRead(t *testing.T) {
	f := startHTTP(t, testLimits())
	c, err := dialFrom("127.0.0.1", f.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: 100000\r\n\r\n{", f.addr)
	stop := make(chan struct{})
	var sent sync.WaitGroup
	sent.Add(1)
	go func() { // one byte every 50 ms: the body would take over an hour
		defer sent.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
				if _, err := c.Write([]byte(" ")); err != nil {
					return
				}
			}
		}
	}()
	defer func() { close(stop); sent.Wait() }()

	// During the attack a legitimate client is served.
	f.legit(t, "127.0.0.2")

	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no response to an unauthenticated POST whose body is still arriving: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("status %d, want 401", resp.StatusCode)
	}
	if !resp.Close {
		t.Error("the 401 does not close the connection")
	}
	if !waitClosed(c, 10*time.Second) {
		t.Error("the server kept the unauthenticated connection open")
	}
}

// TestHTTPUnauthenticatedKeepAliveClosed: an unauthenticated request
// (GET /healthz, a 401) does not leave a keep-alive connection behind, and
// an authenticated connection left idle is closed after IdleTimeout.
func TestHTTPUnauthenticatedKeepAliveClosed(t *testing.T) {
	lim := testLimits()
	lim.IdleTimeout = 500 * time.Millisecond
	f := startHTTP(t, lim)
	const n = 40
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range n {
		c, err := dialFrom(fmt.Sprintf("127.0.1.%d", 1+i%4), f.addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: %s\r\n\r\n", f.addr)
	}
	f.legit(t, "127.0.0.2")
	if open := n - countClosed(conns, 5*time.Second); open > 0 {
		t.Errorf("%d of %d unauthenticated keep-alive connections still open after their response", open, n)
	}

	// An authenticated keep-alive connection is closed once idle.
	c, err := dialFrom("127.0.0.3", f.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s", f.addr, f.secret, len(initBody), initBody)
	br := bufio.NewReader(c)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Close {
		t.Fatalf("authenticated initialize: status %d, close %v", resp.StatusCode, resp.Close)
	}
	if !waitClosed(c, 10*time.Second) {
		t.Error("an idle authenticated keep-alive connection was not closed after IdleTimeout")
	}
}

// TestHTTPConnsPerAddr: one client address cannot hold more than
// MaxConnsPerAddr connections; connections past the cap are closed at
// once, and a client at another address is served meanwhile.
func TestHTTPConnsPerAddr(t *testing.T) {
	lim := testLimits()
	lim.MaxConnsPerAddr = 8
	lim.MaxConns = 256
	f := startHTTP(t, lim)
	const n = 200
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range n {
		c, err := dialFrom("127.0.0.1", f.addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	lat := f.legit(t, "127.0.0.2")
	t.Logf("legitimate client served in %v with %d idle connections from one address", lat, n)
	closed := countClosed(conns, 3*time.Second)
	if want := n - lim.MaxConnsPerAddr; closed < want {
		t.Errorf("the server closed %d of %d idle connections from one address, want at least %d (cap %d)", closed, n, want, lim.MaxConnsPerAddr)
	}
}

// TestHTTPMaxConns: with MaxConns connections open, one more is not
// served until the server has dropped one of them (idle connections are
// dropped after HeaderTimeout); then it is.
func TestHTTPMaxConns(t *testing.T) {
	lim := testLimits()
	lim.MaxConns = 8
	lim.MaxConnsPerAddr = 4
	lim.HeaderTimeout = time.Second
	f := startHTTP(t, lim)
	var (
		mu        sync.Mutex
		firstDrop time.Time
		wg        sync.WaitGroup
	)
	for i := range lim.MaxConns {
		c, err := dialFrom(fmt.Sprintf("127.0.2.%d", 1+i/4), f.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			if waitClosed(c, 20*time.Second) {
				mu.Lock()
				if firstDrop.IsZero() {
					firstDrop = time.Now()
				}
				mu.Unlock()
			}
		}()
	}
	time.Sleep(100 * time.Millisecond) // let the server accept all of them
	f.legit(t, "127.0.0.2")
	served := time.Now()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	// The server drops one before it serves the new one; the goroutine that
	// sees the drop may wake after the client saw its answer, so the order
	// is checked with half the header timeout of slack: a server that
	// served first would drop nothing until the header timeout.
	if firstDrop.IsZero() || firstDrop.Sub(served) > lim.HeaderTimeout/2 {
		t.Errorf("a connection past MaxConns=%d was served (at %v) before the server dropped any of the %d open ones (first drop %v)",
			lim.MaxConns, served.Format(time.StampMilli), lim.MaxConns, firstDrop.Format(time.StampMilli))
	}
}

// postHead writes the head of an authenticated POST /mcp with a body of
// length n.
func postHead(w io.Writer, f *httpFixture, n int) {
	fmt.Fprintf(w, "POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n", f.addr, f.secret, n)
}

// TestHTTPInflightBytes: the bytes of request bodies held at once are
// bounded across all requests. One large body that stalls holds the
// budget; a second large body waits for it and is read only after the
// first is gone, while a small request is served meanwhile.
func TestHTTPInflightBytes(t *testing.T) {
	lim := testLimits()
	lim.MaxInflightBytes = 1 << 20
	lim.ReadTimeout = 30 * time.Second
	lim.WriteTimeout = 500 * time.Millisecond
	f := startHTTP(t, lim)
	const size = 700 << 10
	body := initBody + strings.Repeat(" ", size-len(initBody))

	first, err := dialFrom("127.0.0.1", f.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	postHead(first, f, size)
	io.WriteString(first, body[:100<<10]) // and stall
	time.Sleep(200 * time.Millisecond)

	second, err := dialFrom("127.0.0.3", f.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	answered := make(chan time.Time, 1)
	go func() {
		defer close(answered)
		second.SetReadDeadline(time.Now().Add(30 * time.Second))
		br := bufio.NewReader(second)
		for {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				return
			}
			if resp.StatusCode != http.StatusContinue {
				answered <- time.Now()
				return
			}
		}
	}()
	// It asks for 100 Continue, which is written when its body is first
	// read: after a wait longer than WriteTimeout.
	fmt.Fprintf(second, "POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nAuthorization: Bearer %s\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", f.addr, f.secret, size)
	go io.WriteString(second, body)

	f.legit(t, "127.0.0.2") // small requests are not held up
	time.Sleep(time.Second)
	released := time.Now()
	first.Close()
	at, ok := <-answered
	if !ok {
		t.Fatal("the second large request got no answer")
	}
	if at.Before(released) {
		t.Errorf("a second %d KiB body was read while a first one held the %d KiB budget (answered %v before the first was closed)",
			size>>10, lim.MaxInflightBytes>>10, released.Sub(at))
	}
}

// initSession initializes a transport session as the token's principal
// and returns its Mcp-Session-Id.
func (f *httpFixture) initSession(t *testing.T, secret string) string {
	t.Helper()
	resp := f.post(t, secret, "", initBody)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("initialize: status %d", resp.StatusCode)
	}
	sid := resp.Header.Get("Mcp-Session-Id")
	if sid == "" {
		t.Fatal("initialize: no Mcp-Session-Id")
	}
	if resp := f.post(t, secret, sid, `{"jsonrpc":"2.0","method":"notifications/initialized"}`); resp.StatusCode != http.StatusAccepted {
		t.Fatalf("initialized: status %d", resp.StatusCode)
	}
	return sid
}

// ping sends a ping in session sid and returns the HTTP status.
func (f *httpFixture) ping(t *testing.T, secret, sid string) int {
	t.Helper()
	return f.post(t, secret, sid, `{"jsonrpc":"2.0","id":2,"method":"ping"}`).StatusCode
}

func (f *httpFixture) post(t *testing.T, secret, sid, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest("POST", "http://"+f.addr+"/mcp", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "Bearer "+secret)
	if sid != "" {
		req.Header.Set("Mcp-Session-Id", sid)
		req.Header.Set("Mcp-Protocol-Version", "2025-06-18")
	}
	c := &http.Client{Timeout: 15 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

func (f *httpFixture) liveSessions() int {
	n := 0
	for range f.srv.MCP().Sessions() {
		n++
	}
	return n
}

// TestHTTPSessionsExpire: an MCP transport session that receives no
// request for SessionIdle is closed.
func TestHTTPSessionsExpire(t *testing.T) {
	lim := testLimits()
	lim.SessionIdle = 300 * time.Millisecond
	f := startHTTP(t, lim)
	sid := f.initSession(t, f.secret)
	if st := f.ping(t, f.secret, sid); st != http.StatusOK {
		t.Fatalf("ping in a fresh session: %d", st)
	}
	deadline := time.Now().Add(10 * time.Second)
	for f.liveSessions() > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if st := f.ping(t, f.secret, sid); st != http.StatusNotFound {
		t.Errorf("ping in a session idle for longer than %v: status %d, want 404", lim.SessionIdle, st)
	}
	f.legit(t, "127.0.0.2")
}

// TestHTTPSessionsPerPrincipal: one principal's initialize flood closes
// its own least recently used sessions past MaxSessions; another
// principal's session is untouched.
func TestHTTPSessionsPerPrincipal(t *testing.T) {
	lim := testLimits()
	lim.SessionIdle = time.Hour
	lim.MaxSessions = 3
	f := startHTTP(t, lim)
	bob := strings.Repeat("b", 32)
	bobSID := f.initSession(t, bob)
	var sids []string
	for range 20 {
		sids = append(sids, f.initSession(t, f.secret))
	}
	if n := f.liveSessions(); n > lim.MaxSessions+1 {
		t.Errorf("%d transport sessions live after 20 initialize calls by one principal, want at most %d (cap) + 1 (another principal)", n, lim.MaxSessions+1)
	}
	if st := f.ping(t, bob, bobSID); st != http.StatusOK {
		t.Errorf("another principal's session: status %d, want 200", st)
	}
	if st := f.ping(t, f.secret, sids[len(sids)-1]); st != http.StatusOK {
		t.Errorf("the newest session: status %d, want 200", st)
	}
	if st := f.ping(t, f.secret, sids[0]); st != http.StatusNotFound {
		t.Errorf("the oldest of 20 sessions: status %d, want 404", st)
	}
}

// countingTransport adds the bearer token and counts GET requests (the
// client's standalone SSE stream, reopened whenever it is cut).
type countingTransport struct {
	token string
	mu    sync.Mutex
	gets  int
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+c.token)
	if r.Method == http.MethodGet {
		c.mu.Lock()
		c.gets++
		c.mu.Unlock()
	}
	return http.DefaultTransport.RoundTrip(r)
}

// TestHTTPLongCallNotCut: with read, write and idle timeouts of one
// second, a tool call of three seconds returns its result and the
// client's standalone SSE stream stays open across them: the timeouts
// drop slow clients, not long calls or quiet streams.
func TestHTTPLongCallNotCut(t *testing.T) {
	srv := serve(t, sessiontest.New(t, nil), session.Options{Mode: session.ModeSession, DefaultTimeout: 20 * time.Second, MaxOutput: 2000, Grace: time.Second})
	lim := testLimits()
	lim.ReadTimeout, lim.WriteTimeout, lim.IdleTimeout = time.Second, time.Second, time.Second
	f := serveHTTP(t, srv, lim)

	for _, version := range []string{"2025-11-25", ""} { // sessionful, then the latest (stateless)
		t.Run("protocol "+version, func(t *testing.T) {
			rt := &countingTransport{token: f.secret}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cs, err := mcp.NewClient(&mcp.Implementation{Name: "t", Version: "1"}, nil).Connect(ctx,
				&mcp.StreamableClientTransport{Endpoint: "http://" + f.addr + "/mcp", HTTPClient: &http.Client{Transport: rt}},
				&mcp.ClientSessionOptions{ProtocolVersion: version})
			if err != nil {
				t.Fatal(err)
			}
			defer cs.Close()
			for i := range 2 {
				res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "run_shell", Arguments: map[string]any{"command": "sleep 3; echo done-" + fmt.Sprint(i)}})
				if err != nil {
					t.Fatalf("call %d of 3 s with 1 s timeouts: %v", i, err)
				}
				if got := text(res); res.IsError || !strings.Contains(got, fmt.Sprintf("done-%d", i)) {
					t.Fatalf("call %d: %q", i, got)
				}
			}
			rt.mu.Lock()
			defer rt.mu.Unlock()
			want := 0 // the 2026-07-28 revision has no standalone stream
			if init := cs.InitializeResult(); init != nil && init.ProtocolVersion < "2026-07-28" {
				want = 1
			}
			if rt.gets != want {
				t.Errorf("the client opened its SSE stream %d times in 6 s, want %d: the timeouts cut it", rt.gets, want)
			}
		})
	}
}
