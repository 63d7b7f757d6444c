package egress

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// tlsAccessDenied is a fatal TLS alert record, access_denied (RFC 8446 6.2),
// sent to a box whose TLS connection is refused so its client reports it.
var tlsAccessDenied = []byte{21, 3, 3, 0, 2, 2, 49}

// serveTransparent handles one TCP connection the box's firewall redirected
// to the gateway. A TLS connection is relayed to the name its ClientHello
// names (SNI), on the port the box dialed, if the policy allows it. A
// plain HTTP connection goes to the gateway's HTTP server, which checks
// and forwards each request on it by its own Host. The address the box
// dialed is never used.
func (c *core) serveTransparent(ctx context.Context, conn *boxConn, port uint16) {
	a := conn.att
	conn.SetReadDeadline(time.Now().Add(c.opts.SniffTimeout))
	br := bufio.NewReaderSize(conn, sniffBuffer)
	first, err := br.Peek(1)
	if err != nil {
		conn.Close()
		return
	}
	if first[0] != 22 { // not a TLS handshake record: HTTP, or nothing we serve
		conn.SetReadDeadline(time.Time{})
		c.http.push(&httpConn{boxConn: conn, r: unbuffered(br, conn), info: connInfo{via: "http", port: port}})
		return
	}
	handedOff := false // to the HTTP server, which closes it
	defer func() {
		if !handedOff {
			conn.Close()
		}
	}()
	name, err := sniffTLS(br)
	if errors.Is(err, errNoSNI) {
		err = errors.New("the TLS ClientHello names no server (SNI); connect by an allowed host name, not an IP address")
	}
	if err != nil {
		reason := "cannot read the destination host name: " + err.Error()
		c.refuse(a, Refusal{Via: "tls", Port: port, Reason: reason})
		refuseStream(conn, true, http403, reason)
		return
	}
	conn.SetReadDeadline(time.Time{})
	if c.intercepts(a, name, port) {
		handedOff = true
		c.intercept(conn, unbuffered(br, conn), "tls", name, port)
		return
	}

	up, err := c.dial(ctx, a, "tls", name, port)
	if err != nil {
		refuseStream(conn, true, http403, err.Error())
		return
	}
	splice(conn, unbuffered(br, conn), up)
}

// refuseStream tells a box's client why its connection ends: a TLS alert,
// or an HTTP answer with status (http403, http503) whose body is the
// reason.
func refuseStream(conn net.Conn, isTLS bool, status, msg string) {
	conn.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if isTLS {
		conn.Write(tlsAccessDenied)
		return
	}
	body := "kiln egress: " + msg + "\n"
	fmt.Fprintf(conn, "HTTP/1.1 %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\nX-Kiln-Egress: refused\r\n\r\n%s", status, len(body), body)
}

// splice relays between the box and the destination until both directions
// end. boxR reads from box, including bytes already sniffed.
func splice(box net.Conn, boxR io.Reader, up net.Conn) {
	defer up.Close()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if _, err := io.Copy(up, boxR); err != nil {
			up.Close()
			box.Close()
			return
		}
		closeWrite(up)
	}()
	if _, err := io.Copy(box, up); err != nil {
		up.Close()
		box.Close()
	} else {
		closeWrite(box)
	}
	wg.Wait()
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite()
	}
}

// connInfo describes a plain HTTP connection that reached the gateway's
// HTTP server other than as a proxy connection: transparently, or inside
// a CONNECT tunnel.
type connInfo struct {
	via  string // "http" (transparent) or "connect"
	port uint16 // the destination port: the one the box dialed, or the CONNECT's
	name string // for a CONNECT tunnel or intercepted TLS, the name it was opened to
	tls  bool   // the box's TLS, terminated by the gateway: its requests go out over TLS
}

type (
	connInfoKey struct{}
	viaKey      struct{}
)

// httpConn is a box connection handed to the gateway's HTTP server after
// its first bytes were read; reads start with those bytes.
type httpConn struct {
	*boxConn
	r    io.Reader
	info connInfo
}

func (h *httpConn) Read(p []byte) (int, error) { return h.r.Read(p) }

// connContext lets the handler see how a connection reached the server.
func connContext(ctx context.Context, conn net.Conn) context.Context {
	switch h := conn.(type) {
	case *httpConn:
		return context.WithValue(ctx, connInfoKey{}, h.info)
	case *tlsHTTPConn:
		return context.WithValue(ctx, connInfoKey{}, h.info)
	}
	return ctx
}

// connQueue is the listener of connections handed to the HTTP server.
type connQueue struct {
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
	addr net.Addr
}

func newConnQueue(addr net.Addr) *connQueue {
	return &connQueue{ch: make(chan net.Conn), done: make(chan struct{}), addr: addr}
}

func (q *connQueue) push(c net.Conn) {
	select {
	case q.ch <- c:
	case <-q.done:
		c.Close()
	}
}

func (q *connQueue) Accept() (net.Conn, error) {
	select {
	case c := <-q.ch:
		return c, nil
	case <-q.done:
		return nil, net.ErrClosed
	}
}

func (q *connQueue) Close() error   { q.once.Do(func() { close(q.done) }); return nil }
func (q *connQueue) Addr() net.Addr { return q.addr }

// limitListener admits each connection a box opens to the proxy port or
// to DNS over TCP against the box's and the gateway's connection limits.
type limitListener struct {
	net.Listener
	c   *core
	via string // "proxy" or "dns"
}

func (l limitListener) Accept() (net.Conn, error) {
	for {
		conn, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if b := l.c.admit(conn, l.via, 0); b != nil {
			return b, nil
		}
	}
}

// unbuffered returns a reader of what br holds and then of r, so the
// sniffing buffer is not kept for the connection's life.
func unbuffered(br *bufio.Reader, r io.Reader) io.Reader {
	n := br.Buffered()
	if n == 0 {
		return r
	}
	b, _ := br.Peek(n)
	return io.MultiReader(bytes.NewReader(bytes.Clone(b)), r)
}

// proxyHandler serves the gateway's HTTP server: on the proxy port
// (HTTP_PROXY / HTTPS_PROXY) CONNECT to host:port and plain HTTP requests
// with an absolute http:// URL; for transparent and tunnelled plain HTTP,
// each request by its Host. Every request goes out to, and with the Host
// of, the name the policy checked.
func (c *core) proxyHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a := c.boxAtString(r.RemoteAddr)
		if a == nil {
			w.Header().Set("Connection", "close")
			http.Error(w, "kiln egress: unknown box", http.StatusForbidden)
			return
		}
		if info, ok := r.Context().Value(connInfoKey{}).(connInfo); ok {
			c.serveOrigin(w, r, a, info)
			return
		}
		if r.Method == http.MethodConnect {
			c.serveConnect(w, r, a)
			return
		}
		if r.URL.Scheme != "http" || r.URL.Host == "" {
			badRequest(w, "kiln egress proxy: only CONNECT and absolute http:// URLs")
			return
		}
		// The server took the request's Host from its URL; the Host header
		// the box sent is ignored.
		host, port := r.URL.Hostname(), uint16(80)
		if p := r.URL.Port(); p != "" {
			n, err := strconv.ParseUint(p, 10, 16)
			if err != nil || n == 0 {
				badRequest(w, "kiln egress proxy: bad port in "+clip(r.URL.Host, maxNameLen))
				return
			}
			port = uint16(n)
		}
		c.forward(w, r, a, "proxy", host, port)
	})
}

// serveOrigin serves one request of a transparent or tunnelled plain HTTP
// connection: it goes to the name in its Host, on the connection's port.
// In a tunnel the Host must be the name the tunnel was opened to.
func (c *core) serveOrigin(w http.ResponseWriter, r *http.Request, a *Attachment, info connInfo) {
	if r.Method == http.MethodConnect {
		badRequest(w, "kiln egress: CONNECT only to the proxy")
		return
	}
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = normalizeName(strings.Trim(host, "[]"))
	if host == "" {
		reason := "cannot read the destination host name: HTTP request has no Host"
		writeProxyError(w, c.refuse(a, Refusal{Via: info.via, Port: info.port, Reason: reason}))
		return
	}
	if info.name != "" && host != info.name {
		writeProxyError(w, c.refuse(a, Refusal{Via: info.via, Name: host, Port: info.port,
			Reason: "the request's Host is not " + info.name + ", the name the tunnel was opened to"}))
		return
	}
	c.forward(w, r, a, info.via, host, info.port)
}

// forward sends r to host:port (dialed through the policy check) with
// Host: host.
func (c *core) forward(w http.ResponseWriter, r *http.Request, a *Attachment, via, host string, port uint16) {
	u := *r.URL
	u.Scheme = "http"
	u.Host = strings.TrimSuffix(net.JoinHostPort(normalizeName(host), strconv.Itoa(int(port))), ":80")
	ctx := context.WithValue(r.Context(), viaKey{}, via)
	if info, _ := r.Context().Value(connInfoKey{}).(connInfo); info.tls {
		u.Scheme = "https"
		u.Host = strings.TrimSuffix(net.JoinHostPort(normalizeName(host), strconv.Itoa(int(port))), ":443")
		var err error
		if ctx, err = c.withSecrets(ctx, r, normalizeName(host)); err != nil {
			writeProxyError(w, err)
			return
		}
	}
	out := r.WithContext(ctx)
	out.URL, out.Host = &u, ""
	a.proxy.ServeHTTP(w, out)
}

func badRequest(w http.ResponseWriter, msg string) {
	w.Header().Set("Connection", "close")
	http.Error(w, msg, http.StatusBadRequest)
}

// serveConnect opens a tunnel to the CONNECT's host:port. What the box
// sends through it must be TLS whose SNI, if any, is that host, or plain
// HTTP, which is then served request by request with that Host.
func (c *core) serveConnect(w http.ResponseWriter, r *http.Request, a *Attachment) {
	host, port, err := splitHostPort(r.Host)
	if err != nil {
		badRequest(w, "kiln egress proxy: "+clip(err.Error(), maxReasonLen))
		return
	}
	host = normalizeName(host)
	up, err := c.dial(r.Context(), a, "connect", host, port)
	if err != nil {
		writeProxyError(w, err)
		return
	}
	raw, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		up.Close()
		http.Error(w, "kiln egress proxy: "+err.Error(), http.StatusInternalServerError)
		return
	}
	conn, ok := raw.(*boxConn)
	if !ok {
		up.Close()
		raw.Close()
		return
	}
	if _, err := io.WriteString(conn, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		up.Close()
		conn.Close()
		return
	}
	conn.SetReadDeadline(time.Now().Add(c.opts.SniffTimeout))
	br := bufio.NewReaderSize(brw.Reader, sniffBuffer)
	first, err := br.Peek(1)
	if err != nil {
		up.Close()
		conn.Close()
		return
	}
	if first[0] != 22 {
		// Plain HTTP: served like a transparent connection, each request
		// dialed by its own (checked) Host.
		up.Close()
		conn.SetReadDeadline(time.Time{})
		c.http.push(&httpConn{boxConn: conn, r: unbuffered(br, brw.Reader), info: connInfo{via: "connect", port: port, name: host}})
		return
	}
	handedOff := false // to the HTTP server, which closes it
	defer func() {
		if !handedOff {
			conn.Close()
		}
	}()
	sni, err := sniffTLS(br)
	switch {
	case errors.Is(err, errNoSNI):
		err = nil // nothing to check; the tunnel's name was
	case err != nil:
		err = c.refuse(a, Refusal{Via: "connect", Name: host, Port: port, Reason: "cannot read the TLS ClientHello: " + err.Error()})
	case normalizeName(sni) != host:
		err = c.refuse(a, Refusal{Via: "connect", Name: sni, Port: port,
			Reason: "the TLS server name (SNI) is not " + host + ", the name the tunnel was opened to"})
	}
	if err != nil {
		up.Close()
		refuseStream(conn, true, http403, "")
		return
	}
	conn.SetReadDeadline(time.Time{})
	if c.intercepts(a, host, port) {
		up.Close()
		handedOff = true
		c.intercept(conn, unbuffered(br, brw.Reader), "connect", host, port)
		return
	}
	splice(conn, unbuffered(br, brw.Reader), up)
}

// writeProxyError answers 403 with the reason for refusals and 502 for
// other faults of reaching the destination.
func writeProxyError(w http.ResponseWriter, err error) {
	w.Header().Set("Connection", "close")
	var re *RefusedError
	if errors.As(err, &re) {
		w.Header().Set("X-Kiln-Egress", "refused")
		http.Error(w, "kiln egress: "+re.Error(), http.StatusForbidden)
		return
	}
	http.Error(w, "kiln egress: "+err.Error(), http.StatusBadGateway)
}

// proxyURL is the HTTP(S)_PROXY value for a gateway at host:port.
func proxyURL(host string, port uint16) string {
	return "http://" + net.JoinHostPort(host, strconv.Itoa(int(port)))
}
