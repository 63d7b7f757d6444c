package egress

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// tlsAccessDenied is a fatal TLS alert record, access_denied (RFC 8446 6.2),
// sent to a box whose TLS connection is refused so its client reports it.
var tlsAccessDenied = []byte{21, 3, 3, 0, 2, 2, 49}

// serveTransparent handles one TCP connection the box's firewall redirected
// to the gateway: it reads the destination name from the TLS ClientHello
// (SNI) or the HTTP request head, and relays the connection to that name on
// the port the box dialed if the policy allows it. The address the box
// dialed is never used.
func (c *core) serveTransparent(ctx context.Context, conn net.Conn, port uint16) {
	defer conn.Close()
	a := c.boxAt(conn.RemoteAddr())
	if a == nil || !a.track(conn) {
		return
	}
	defer a.untrack(conn)

	conn.SetReadDeadline(time.Now().Add(c.opts.SniffTimeout))
	br := bufio.NewReaderSize(conn, sniffBuffer)
	first, err := br.Peek(1)
	if err != nil {
		return
	}
	isTLS := first[0] == 22
	via, name := "http", ""
	if isTLS {
		via = "tls"
		name, err = sniffTLS(br)
		if errors.Is(err, errNoSNI) {
			err = errors.New("the TLS ClientHello names no server (SNI); connect by an allowed host name, not an IP address")
		}
	} else {
		name, err = sniffHTTP(br)
	}
	if err != nil {
		c.refuse(a, Refusal{Via: via, Port: port, Reason: "cannot read the destination host name: " + err.Error()})
		refuseStream(conn, isTLS, "cannot read the destination host name: "+err.Error())
		return
	}
	conn.SetReadDeadline(time.Time{})

	up, err := c.dial(ctx, a, via, name, port)
	if err != nil {
		refuseStream(conn, isTLS, err.Error())
		return
	}
	splice(conn, br, up)
}

// refuseStream tells a box's client why its connection ends: a TLS alert,
// or an HTTP 403 whose body is the reason.
func refuseStream(conn net.Conn, isTLS bool, msg string) {
	conn.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if isTLS {
		conn.Write(tlsAccessDenied)
		return
	}
	body := "kiln egress: " + msg + "\n"
	fmt.Fprintf(conn, "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\nX-Kiln-Egress: refused\r\n\r\n%s", len(body), body)
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

// proxyHandler serves HTTP_PROXY / HTTPS_PROXY: CONNECT to host:port, and
// plain HTTP requests with an absolute http:// URL.
func (c *core) proxyHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a := c.boxAtString(r.RemoteAddr)
		if a == nil {
			http.Error(w, "kiln egress: unknown box", http.StatusForbidden)
			return
		}
		if r.Method == http.MethodConnect {
			c.serveConnect(w, r, a)
			return
		}
		if r.URL.Scheme != "http" || r.URL.Host == "" {
			http.Error(w, "kiln egress proxy: only CONNECT and absolute http:// URLs", http.StatusBadRequest)
			return
		}
		a.proxy.ServeHTTP(w, r)
	})
}

func (c *core) serveConnect(w http.ResponseWriter, r *http.Request, a *Attachment) {
	host, port, err := splitHostPort(r.Host)
	if err != nil {
		http.Error(w, "kiln egress proxy: "+err.Error(), http.StatusBadRequest)
		return
	}
	up, err := c.dial(r.Context(), a, "connect", host, port)
	if err != nil {
		writeProxyError(w, err)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		up.Close()
		http.Error(w, "kiln egress proxy: "+err.Error(), http.StatusInternalServerError)
		return
	}
	defer conn.Close()
	if !a.track(conn) {
		up.Close()
		return
	}
	defer a.untrack(conn)
	if _, err := io.WriteString(conn, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		up.Close()
		return
	}
	splice(conn, brw.Reader, up)
}

// writeProxyError answers 403 with the reason for refusals and 502 for
// other faults of reaching the destination.
func writeProxyError(w http.ResponseWriter, err error) {
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
