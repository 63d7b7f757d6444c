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

	"github.com/miekg/dns"
)

// TestCut: once a box is cut, the gateway refuses its lookups and
// connections, names why, and closes the connection it held open.
func TestCut(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-cut", "web.test")
	gw := w.gw.GatewayAddr()

	// A tunnel opened before the cut, kept alive across it.
	var conn net.Conn
	err := inNetNS(b.ns, func() (err error) {
		conn, err = net.DialTimeout("tcp4", net.JoinHostPort(gw.String(), fmt.Sprint(w.gw.opts.ProxyPort)), 5*time.Second)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
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
		var raw net.Conn
		err := inNetNS(b.ns, func() (err error) {
			raw, err = net.DialTimeout("tcp4", net.JoinHostPort(gw.String(), fmt.Sprint(w.gw.opts.ProxyPort)), 5*time.Second)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { raw.Close() })
		rbr := bufio.NewReader(raw)
		fmt.Fprintf(raw, "CONNECT web.test:443 HTTP/1.1\r\nHost: web.test:443\r\n\r\n")
		resp, err := http.ReadResponse(rbr, nil)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("CONNECT :443 before the cut: %v %v", resp, err)
		}
		pemCA, err := os.ReadFile(w.caFile)
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
