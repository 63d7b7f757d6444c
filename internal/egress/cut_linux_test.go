//go:build linux

package egress

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"kiln/internal/netnsrun"

	"github.com/miekg/dns"
)

// TestCut: once a box is cut, the gateway refuses its lookups and
// connections, names why, and closes the connection it held open.
func TestCut(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-cut", "web.test")
	gw := w.gw.GatewayAddr()

	// A tunnel opened before the cut, kept alive across it.
	conn := b.dialProxy(t)
	br := bufio.NewReader(conn)
	fmt.Fprintf(conn, "CONNECT web.test:80 HTTP/1.1\r\nHost: web.test:80\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT before the cut: %v %v", resp, err)
	}
	fmt.Fprintf(conn, "GET /before HTTP/1.1\r\nHost: web.test\r\n\r\n")
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if string(body) != "web:web.test/before" {
		t.Fatalf("through the tunnel before the cut: %q", body)
	}

	// A TLS tunnel relays bytes over one upstream connection: the cut
	// must close it.
	tunnel := func() (*tls.Conn, *bufio.Reader) {
		raw := b.dialProxy(t)
		rbr := bufio.NewReader(raw)
		fmt.Fprintf(raw, "CONNECT web.test:443 HTTP/1.1\r\nHost: web.test:443\r\n\r\n")
		resp, err := http.ReadResponse(rbr, nil)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("CONNECT :443 before the cut: %v %v", resp, err)
		}
		pemCA, err := os.ReadFile(w.CAFile)
		if err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(pemCA)
		tc := tls.Client(&bufferedConn{Conn: raw, r: rbr}, &tls.Config{ServerName: "web.test", RootCAs: pool})
		return tc, bufio.NewReader(tc)
	}
	tc, tbr := tunnel()
	fmt.Fprintf(tc, "GET /tls-before HTTP/1.1\r\nHost: web.test\r\n\r\n")
	resp, err = http.ReadResponse(tbr, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	if string(body) != "web:web.test/tls-before" {
		t.Fatalf("through the TLS tunnel before the cut: %q", body)
	}

	b.att.Cut()
	tc.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(tc, "GET /tls-after HTTP/1.1\r\nHost: web.test\r\n\r\n")
	if resp, err := http.ReadResponse(tbr, nil); err == nil {
		body, _ := io.ReadAll(resp.Body)
		t.Errorf("the TLS tunnel opened before the cut still works: %d %q", resp.StatusCode, body)
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Errorf("the TLS tunnel was left open (read timed out) instead of closed")
	}
	if !b.att.IsCut() {
		t.Fatal("IsCut is false after Cut")
	}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "GET /after HTTP/1.1\r\nHost: web.test\r\n\r\n")
	// Plain HTTP in a tunnel is dialed per request, so the answer is a
	// refusal or a closed connection, never the page.
	if resp, err := http.ReadResponse(br, nil); err == nil {
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode == http.StatusOK || strings.Contains(string(body), "web:") {
			t.Errorf("the tunnel opened before the cut still works: %d %q", resp.StatusCode, body)
		}
	}

	if got := b.fetch(t, nil, "http://web.test/cut"); strings.HasPrefix(got, "OK") {
		t.Errorf("fetch after the cut: %q", got)
	}
	if resp, err := b.query(t, gw, "udp", "web.test", dns.TypeA); err != nil || resp.Rcode != dns.RcodeRefused {
		t.Errorf("DNS after the cut: %v %v, want REFUSED", resp, err)
	}
	refusalsContain(t, b.att, reasonCut)
}

// bufferedConn reads what a bufio.Reader already took from Conn first.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// TestRestrict: a per-principal allowlist narrows a box's policy for good.
// What the narrower list leaves out is refused by name, by DNS and inside
// a tunnel opened before; what it keeps still works; a later, different
// list narrows further and never widens back.
func TestRestrict(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-restrict", "web.test", "pypi.test")
	gw := w.gw.GatewayAddr()
	wantPrefix(t, b.fetch(t, nil, "http://web.test/before"), "OK 200 web:web.test/before")

	// A TLS tunnel to web.test, open across the restriction.
	raw := b.dialProxy(t)
	rbr := bufio.NewReader(raw)
	fmt.Fprintf(raw, "CONNECT web.test:443 HTTP/1.1\r\nHost: web.test:443\r\n\r\n")
	if resp, err := http.ReadResponse(rbr, nil); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT before the restriction: %v %v", resp, err)
	}

	b.att.Restrict(MustParsePolicy("pypi.test", "other.test"))
	if got := b.att.Policy().String(); got != "pypi.test" {
		t.Errorf("policy after Restrict(pypi.test, other.test) = %q, want pypi.test (other.test was never allowed)", got)
	}
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := rbr.ReadByte(); err == nil {
		t.Error("the tunnel to web.test opened before the restriction is still open")
	}
	if got := b.fetch(t, nil, "http://web.test/after"); strings.HasPrefix(got, "OK") {
		t.Errorf("web.test after the restriction: %q", got)
	}
	if resp, err := b.query(t, gw, "udp", "web.test", dns.TypeA); err != nil || resp.Rcode != dns.RcodeRefused {
		t.Errorf("DNS for web.test after the restriction: %v %v, want REFUSED", resp, err)
	}
	if resp, err := b.query(t, gw, "udp", "pypi.test", dns.TypeA); err != nil || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
		t.Errorf("DNS for pypi.test, still allowed: %v %v", resp, err)
	}
	wantPrefix(t, b.fetch(t, nil, "http://pypi.test/kept"), "HTTP 404") // the index answers; the name is reachable

	// Never wider: web.test stays refused, and pypi.test goes too.
	b.att.Restrict(MustParsePolicy("web.test"))
	if !b.att.Policy().Empty() {
		t.Errorf("policy after a second, disjoint Restrict = %q, want empty", b.att.Policy())
	}
	if got := b.fetch(t, nil, "http://web.test/widened"); strings.HasPrefix(got, "OK") {
		t.Errorf("a second Restrict widened the policy: %q", got)
	}
	refusalsContain(t, b.att, "connection to web.test:80 refused by policy: not in the allowlist (allowed: pypi.test)")
}

// dialProxy opens a connection from inside the box to the gateway's
// proxy port, closed when the test ends.
func (b *box) dialProxy(t *testing.T) net.Conn {
	t.Helper()
	var c net.Conn
	err := netnsrun.In(b.ns, func() (err error) {
		c, err = net.DialTimeout("tcp4", net.JoinHostPort(b.w.gw.GatewayAddr().String(), fmt.Sprint(b.w.gw.opts.ProxyPort)), 5*time.Second)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}
