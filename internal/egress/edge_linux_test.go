//go:build linux

package egress

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The attacks of issue 11 on the gateway, each run against a real gateway
// in the tests' local internet while a legitimate box keeps being served.

// probePy is a box-side client for raw experiments with the gateway. Its
// first argument is the proxy's host:port.
const probePy = `
import socket, select, ssl, sys, time
proxy = sys.argv[1].rsplit(":", 1); proxy = (proxy[0], int(proxy[1]))
mode = sys.argv[2]
args = sys.argv[3:]

def state(s):
    r, _, _ = select.select([s], [], [], 0)
    if not r:
        return "open"
    try:
        d = s.recv(65536)
    except OSError:
        return "reset"
    if not d:
        return "closed"
    line = d.split(b"\r\n")[0].decode(errors="replace")
    return "refused" if " 503 " in line else "data:" + line.replace(" ", "_")

def head(s):
    b = b""
    while b"\r\n\r\n" not in b:
        d = s.recv(4096)
        if not d:
            break
        b += d
    return b

def response(s):
    b = head(s)
    h, _, body = b.partition(b"\r\n\r\n")
    n = 0
    for line in h.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v)
    while len(body) < n:
        d = s.recv(4096)
        if not d:
            break
        body += d
    return (h.split(b"\r\n")[0] + b" " + body).decode(errors="replace").strip()

def wait_closed(s, limit):
    t0 = time.time()
    s.settimeout(limit)
    try:
        while True:
            d = s.recv(4096)
            if not d:
                return "closed after %.1fs" % (time.time() - t0)
    except socket.timeout:
        return "open after %.1fs" % limit
    except OSError as e:
        return "closed after %.1fs (%s)" % (time.time() - t0, e)

def tunnel(target):
    s = socket.create_connection(proxy, timeout=10)
    s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
    h = head(s)
    if b" 200 " not in h.split(b"\r\n")[0]:
        print("CONNECT", h.split(b"\r\n")[0].decode(errors="replace"))
        sys.exit(0)
    return s

if mode == "conns":  # open N idle connections to host:port; report after each stdin line
    host, port, n = args[0], int(args[1]), int(args[2])
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(n)]
    while sys.stdin.readline():
        time.sleep(1.5)
        print(" ".join(state(s) for s in socks), flush=True)
elif mode == "idle":  # connect and send nothing
    s = socket.create_connection(proxy, timeout=10)
    print(wait_closed(s, float(args[0])))
elif mode == "idle-tunnel":  # CONNECT, then send nothing
    s = tunnel(args[0])
    print(wait_closed(s, float(args[1])))
elif mode == "trickle-tunnel":  # CONNECT, then trickle a request head forever
    s = tunnel(args[0])
    s.sendall(b"GET / HTTP/1.1\r\nHost: web.test\r\n")
    t0 = time.time()
    try:
        while time.time() - t0 < float(args[1]):
            s.sendall(b"X-Trickle: 1\r\n")
            time.sleep(0.2)
        print("open after %.1fs" % (time.time() - t0))
    except OSError as e:
        print("closed after %.1fs (%s)" % (time.time() - t0, e))
elif mode == "keepalive":  # two requests on one transparent connection
    s = socket.create_connection((args[0], 80), timeout=10)
    for host, path in ((args[1], "/first"), (args[2], "/second")):
        try:
            s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path, host)).encode())
            print("RESP", response(s))
        except OSError as e:
            print("ERR", e)
elif mode == "tunnel-http":  # CONNECT target, then a request with this Host
    s = tunnel(args[0])
    s.sendall(("GET /tunnel HTTP/1.1\r\nHost: %s\r\n\r\n" % args[1]).encode())
    print("RESP", response(s))
elif mode == "tunnel-tls":  # CONNECT target, then TLS with this SNI ("-": none) and Host
    s = tunnel(args[0])
    ctx = ssl.create_default_context(cafile=args[2])
    sni, host = args[1], args[1]
    if sni == "-":
        ctx.check_hostname, sni, host = False, None, args[0].split(":")[0]
    try:
        t = ctx.wrap_socket(s, server_hostname=sni)
        t.sendall(("GET /tls HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host).encode())
        print("RESP", response(t))
    except Exception as e:
        print("ERR", type(e).__name__, e)
elif mode == "refused-then":  # a refused proxy request, then wait for the close
    s = socket.create_connection(proxy, timeout=10)
    s.sendall(b"GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n")
    print("RESP", response(s).split(" ")[1], wait_closed(s, float(args[0])))
elif mode == "flood":  # N refused CONNECTs with a long host name
    n, size = int(args[0]), int(args[1])
    name = "a" * size + ".test"
    got = {}
    for i in range(n):
        s = socket.create_connection(proxy, timeout=10)
        s.sendall(("CONNECT %s:443 HTTP/1.1\r\nHost: %s:443\r\n\r\n" % (name, name)).encode())
        line = head(s).split(b"\r\n")[0].decode(errors="replace")
        got[line] = got.get(line, 0) + 1
        s.close()
    print(got)
`

// probe runs probePy in the box and returns its output.
func (b *box) probe(t *testing.T, args ...string) string {
	t.Helper()
	proxy := b.w.gw.GatewayAddr().String() + ":3128"
	out, err := b.exec(t, nil, b.w.python, append([]string{"-c", probePy, proxy}, args...)...)
	if err != nil {
		t.Fatalf("probe %v: %v\n%s", args, err, out)
	}
	return strings.TrimSpace(out)
}

// holder is a probe in "conns" mode, holding connections open.
type holder struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines *bufio.Scanner
}

func (b *box) hold(t *testing.T, host string, port, n int) *holder {
	t.Helper()
	proxy := b.w.gw.GatewayAddr().String() + ":3128"
	cmd := exec.Command("ip", "netns", "exec", b.name, b.w.python, "-c", probePy, proxy, "conns", host, strconv.Itoa(port), strconv.Itoa(n))
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cmd.Process.Kill(); cmd.Wait() })
	h := &holder{cmd: cmd, in: in, lines: bufio.NewScanner(out)}
	h.lines.Buffer(nil, 1<<20)
	return h
}

// states returns how many of the held connections are in each state.
func (h *holder) states(t *testing.T) map[string]int {
	t.Helper()
	io.WriteString(h.in, "\n")
	if !h.lines.Scan() {
		h.cmd.Wait()
		t.Fatalf("holder ended: %v", h.lines.Err())
	}
	got := map[string]int{}
	for _, s := range strings.Fields(h.lines.Text()) {
		got[s]++
	}
	t.Logf("held connections: %v", got)
	return got
}

// legit checks that box b is served through the proxy and transparently.
func (b *box) legit(t *testing.T) {
	t.Helper()
	wantPrefix(t, b.fetch(t, b.att.Env(), "https://web.test/legit-connect"), "OK 200 web:web.test/legit-connect")
	wantPrefix(t, b.fetch(t, b.att.Env(), "http://web.test/legit-proxy"), "OK 200 web:web.test/legit-proxy")
	wantPrefix(t, b.fetch(t, nil, "https://web.test/legit-tls"), "OK 200 web:web.test/legit-tls")
	wantPrefix(t, b.fetch(t, nil, "http://web.test/legit-http"), "OK 200 web:web.test/legit-http")
}

// TestConnectionCaps is finding 2: one box held 14–15 thousand idle
// connections to the proxy and the server ran out of file descriptors.
// Beyond its own cap a box's connections are refused and closed; at the
// global cap the box holding the most loses its own connections, and
// another box is still served.
func TestConnectionCaps(t *testing.T) {
	w := newWorld(t, func(o *Options) { o.MaxConnsPerBox, o.MaxConns = 8, 12 })
	hog := w.newBox(t, "s-hog", "web.test")
	legit := w.newBox(t, "s-legit", "web.test")
	hog2 := w.newBox(t, "s-hog2", "web.test")
	gw := w.gw.GatewayAddr().String()

	h := hog.hold(t, gw, 3128, 20)
	got := h.states(t)
	if got["open"] != 8 || got["refused"] != 12 {
		t.Errorf("hog's 20 proxy connections: %v, want 8 open and 12 refused (503) and closed", got)
	}
	refusalsContain(t, hog.att, "open connections")
	// DNS over TCP is a connection like any other.
	if got := hog.hold(t, gw, 53, 4).states(t); got["closed"]+got["reset"] != 4 {
		t.Errorf("hog's DNS-over-TCP connections beyond its cap: %v, want 4 closed", got)
	}
	legit.legit(t)

	// A second hog, on a transparent port: three boxes share 12, so it
	// gets its share of 4 and no more.
	h2 := hog2.hold(t, "web.test", 80, 10)
	got2 := h2.states(t)
	if got2["open"] != 4 || got2["refused"] != 6 {
		t.Errorf("second hog's 10 connections: %v, want 4 open and 6 refused", got2)
	}
	// The gateway is full; the legitimate box is still served, at the
	// expense of the box holding the most.
	legit.legit(t)
	after := h.states(t)
	if after["open"] >= 8 || after["open"] < 4 {
		t.Errorf("hog's connections after the legitimate box was served: %v, want fewer than 8 and at least 4 open", after)
	}
	if after2 := h2.states(t); after2["open"] != 4 {
		t.Errorf("second hog lost connections it was entitled to: %v", after2)
	}
}

// TestConnectionTimeouts: idle and lifetime limits on box connections.
func TestConnectionTimeouts(t *testing.T) {
	w := newWorld(t, func(o *Options) { o.ConnIdleTimeout, o.ConnMaxLifetime = time.Second, 3*time.Second })
	b := w.newBox(t, "s-slow", "web.test")
	legit := w.newBox(t, "s-legit", "web.test")

	wantPrefix(t, b.probe(t, "idle", "8"), "closed after")
	wantPrefix(t, b.probe(t, "idle-tunnel", "web.test:80", "8"), "closed after")
	// Busy, but past its lifetime.
	wantPrefix(t, b.probe(t, "trickle-tunnel", "web.test:80", "8"), "closed after")
	legit.legit(t)
}

// TestRefusalClosesConnection: a connection that has sent one refused
// request was kept open forever.
func TestRefusalClosesConnection(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-refused", "web.test")
	out := b.probe(t, "refused-then", "5")
	wantPrefix(t, out, "RESP 403 closed after")
	b.legit(t)
}

// TestRefusalLogFlood is finding 6: refused CONNECTs with 20 KB host names
// wrote about 40 MB of logs in a second. Names over 253 bytes are refused
// before they are logged, and refusal logs are rate-limited per box and
// summarized.
func TestRefusalLogFlood(t *testing.T) {
	var logs syncBuffer
	w := newWorld(t, func(o *Options) { o.Logger = slog.New(slog.NewJSONHandler(&logs, nil)) })
	flood := w.newBox(t, "s-flood", "web.test")
	legit := w.newBox(t, "s-legit", "web.test")

	const n, size = 300, 20000
	cmd := exec.Command("ip", "netns", "exec", flood.name, w.python, "-c", probePy, w.gw.GatewayAddr().String()+":3128", "flood", strconv.Itoa(n), strconv.Itoa(size))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	legit.legit(t)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("flood: %v\n%s", err, out.String())
	}
	t.Logf("flood: %s", out.String())
	wantContains(t, out.String(), "403 Forbidden': 300")
	msgs := refusalsContain(t, flood.att, "host name of 20005 bytes")
	for _, m := range msgs {
		if len(m) > 1000 {
			t.Errorf("refusal message of %d bytes", len(m))
			break
		}
	}
	if err := flood.att.Close(); err != nil {
		t.Fatal(err)
	}
	all := logs.String()
	refusals := strings.Count(all, `"verdict":"refuse"`)
	t.Logf("log: %d bytes, %d refusal lines", len(all), refusals)
	if len(all) > 64<<10 {
		t.Errorf("%d refused CONNECTs wrote %d bytes of logs", n, len(all))
	}
	for _, line := range strings.Split(all, "\n") {
		if len(line) > 2000 {
			t.Errorf("log line of %d bytes: %.200s…", len(line), line)
			break
		}
	}
	if refusals >= n {
		t.Errorf("%d refusal log lines for %d refusals: not rate-limited", refusals, n)
	}
	// The rest are summarized, in one line per window.
	summarized := 0
	for _, line := range strings.Split(all, "\n") {
		var rec struct {
			Msg, Session string
			Count        int
		}
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "egress refusals not logged" && rec.Session == "s-flood" {
			summarized += rec.Count
		}
	}
	if refusals+summarized != n {
		t.Errorf("%d refusals logged and %d summarized, want %d in all", refusals, summarized, n)
	}
}

// TestHostMustMatchCheckedName is finding 12: the name the policy checked
// must be the name the destination sees, in the Host header and the SNI.
func TestHostMustMatchCheckedName(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-front", "web.test")
	legit := w.newBox(t, "s-legit", "web.test")

	// HTTP_PROXY with an absolute URL and another Host header: the URL's
	// host is checked, and the request goes out with that Host.
	out, code := b.curl(t, b.att.Env(), "-H", "Host: other.test", "http://web.test/abs")
	if code != 0 || out != "web:web.test/abs" {
		t.Errorf("proxied request with Host: other.test: %d %q, want it sent with Host: web.test", code, out)
	}
	// A transparent connection that asked for web.test, then another name
	// on the same connection.
	out = b.probe(t, "keepalive", "web.test", "web.test", "other.test")
	wantContains(t, out, "RESP HTTP/1.1 200 OK web:web.test/first")
	if strings.Contains(out, "web:other.test") || !strings.Contains(out, "403") {
		t.Errorf("second request on a transparent connection with Host: other.test: %q, want 403", out)
	}
	// CONNECT to an allowed name, then a plain request for another.
	wantContains(t, b.probe(t, "tunnel-http", "web.test:80", "web.test"), "RESP HTTP/1.1 200 OK web:web.test/tunnel")
	out = b.probe(t, "tunnel-http", "web.test:80", "other.test")
	if strings.Contains(out, "web:other.test") || !strings.Contains(out, "403") {
		t.Errorf("CONNECT web.test:80 then Host: other.test: %q, want 403", out)
	}
	// CONNECT to an allowed name, then TLS for another (SNI).
	wantContains(t, b.probe(t, "tunnel-tls", "web.test:443", "web.test", w.CAFile), "RESP HTTP/1.1 200 OK web:web.test/tls")
	// No SNI: nothing to front with at the TLS layer, the tunnel's name holds.
	wantContains(t, b.probe(t, "tunnel-tls", "web.test:443", "-", w.CAFile), "RESP HTTP/1.1 200 OK web:web.test/tls")
	out = b.probe(t, "tunnel-tls", "web.test:443", "other.test", w.CAFile)
	if !strings.HasPrefix(out, "ERR") {
		t.Errorf("CONNECT web.test:443 then TLS with SNI other.test: %q, want a TLS failure", out)
	}
	refusalsContain(t, b.att, "other.test")
	legit.legit(t)
}
