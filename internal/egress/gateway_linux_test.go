//go:build linux

package egress

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"kiln/internal/egress/egresstest"
	"kiln/internal/netnsrun"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// The tests reach a small local internet (egresstest) through the
// gateway and never send a packet off this machine:
//
//	host netns (the test process, where the gateway dials from)
//	  └─ veth ── web netns (egresstest.Internet: web.test, pypi.test, internal.test, the upstream DNS)
//	gateway netns (the Gateway's own) ── veth ── box netns (ip netns add; stands in for the jail's box)
//
// The gateway resolves names through Options.Hosts; only the web host is
// in Options.TestOnlyAllowedAddrs, so the private host is refused like
// any other internal address. The box's own /etc/hosts (ip netns exec
// bind-mounts /etc/netns/<box>/hosts) maps web.test to the private host,
// which must make no difference.

var worldSeq atomic.Int32

type world struct {
	*egresstest.Internet
	t      *testing.T
	gw     *Gateway
	logs   *syncBuffer
	python string
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// requireNetNS skips the test unless it can build network namespaces.
func requireNetNS(t *testing.T) {
	t.Helper()
	egresstest.Need(t)
	for _, tool := range []string{"curl", "python3"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: %s not found (install curl and python3)", tool)
		}
	}
}

// newWorld builds the local internet and a gateway; tune adjusts the
// gateway's options.
func newWorld(t *testing.T, tune ...func(*Options)) *world {
	t.Helper()
	requireNetNS(t)
	w := &world{Internet: egresstest.New(t), t: t, logs: &syncBuffer{}}
	out, err := exec.Command("python3", "-c", "import sys; print(sys.executable)").Output()
	if err != nil {
		t.Skipf("skipping: python3 does not run: %v", err)
	}
	w.python = strings.TrimSpace(string(out))
	opts := Options{
		Logger:               slog.New(slog.NewJSONHandler(io.MultiWriter(w.logs, tWriter{t}), nil)),
		HostsFile:            w.HostsFile,
		Hosts:                w.Hosts,
		TestOnlyAllowedAddrs: w.Allowed(),
		// Names in neither go to the upstream resolver in the web
		// namespace, never to the host's: the tests see every query
		// that leaves the host.
		Resolver: w.Upstream.Resolver(),
		// The web host's certificates, for the TLS the gateway makes
		// itself to a secret's host.
		UpstreamRoots: w.Roots(),
	}
	for _, f := range tune {
		f(&opts)
	}
	gw, err := NewGateway(opts)
	if err != nil {
		t.Fatalf("NewGateway: %v", err)
	}
	t.Cleanup(func() {
		if err := gw.Close(); err != nil {
			t.Errorf("closing gateway: %v", err)
		}
	})
	w.gw = gw
	return w
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", bytes.TrimRight(p, "\n"))
	return len(p), nil
}

// box is a stand-in for a jail box: a named network namespace with a
// process in it, and /etc/netns/<name>/ files that ip netns exec mounts
// over the box's /etc.
type box struct {
	w    *world
	name string
	ns   netns.NsHandle
	pid  int
	att  *Attachment
}

func (w *world) newBox(t *testing.T, session string, policy ...string) *box {
	t.Helper()
	name := fmt.Sprintf("kt%s-box%d", w.ID, worldSeq.Add(1))
	b := &box{w: w, name: name, ns: egresstest.NamedNS(t, name)}
	etc := filepath.Join("/etc/netns", name)
	if err := os.MkdirAll(etc, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(etc) })
	// Inside the box, web.test "is" the internal host. The gateway must
	// not care.
	hosts := fmt.Sprintf("127.0.0.1 localhost\n::1 localhost\n%s web.test\n", w.IntAddr)
	os.WriteFile(filepath.Join(etc, "hosts"), []byte(hosts), 0o644)

	sleeper := exec.Command("ip", "netns", "exec", name, "sleep", "3600")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
	b.pid = sleeper.Process.Pid
	// ip joins the namespace before it execs sleep; wait for that.
	for {
		ns, err := netns.GetFromPid(b.pid)
		if err != nil {
			t.Fatal(err)
		}
		joined := ns.Equal(b.ns)
		ns.Close()
		if joined {
			break
		}
		time.Sleep(time.Millisecond)
	}

	att, err := w.gw.Attach(context.Background(), b.pid, BoxInfo{Session: session, Policy: MustParsePolicy(policy...)})
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	t.Cleanup(func() {
		if err := att.Close(); err != nil {
			t.Errorf("closing attachment: %v", err)
		}
	})
	b.att = att
	// An empty resolv.conf (empty policy) leaves the box with glibc's
	// default, 127.0.0.1, where nothing listens.
	os.WriteFile(filepath.Join(etc, "resolv.conf"), []byte(att.ResolvConf()), 0o644)
	return b
}

// exec runs a command inside the box with a clean environment plus env.
func (b *box) exec(t *testing.T, env []string, name string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("ip", append([]string{"netns", "exec", b.name, name}, args...)...)
	cmd.Env = append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=" + t.TempDir()}, env...)
	out, err := cmd.CombinedOutput()
	t.Logf("box$ %s %s\n%s", name, strings.Join(args, " "), out)
	return string(out), err
}

const fetchPy = `
import sys, ssl, urllib.request, urllib.error
url = sys.argv[1]
ctx = ssl.create_default_context(cafile=sys.argv[2]) if len(sys.argv) > 2 else None
try:
    with urllib.request.urlopen(url, timeout=20, context=ctx) as r:
        print("OK", r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print("HTTP", e.code, e.read().decode())
except Exception as e:
    print("ERR", type(e).__name__, e)
`

// fetch fetches url with Python's urllib inside the box.
func (b *box) fetch(t *testing.T, env []string, url string) string {
	t.Helper()
	out, err := b.exec(t, env, b.w.python, "-c", fetchPy, url, b.w.CAFile)
	if err != nil {
		t.Fatalf("running python in box: %v", err)
	}
	return strings.TrimSpace(out)
}

// curl runs curl in the box and returns its output and exit code.
func (b *box) curl(t *testing.T, env []string, args ...string) (string, int) {
	t.Helper()
	out, err := b.exec(t, env, "curl", append([]string{"-sS", "--max-time", "20", "--cacert", b.w.CAFile}, args...)...)
	if ee, ok := err.(*exec.ExitError); ok {
		return out, ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out, 0
}

// query sends a DNS query from inside the box's namespace.
func (b *box) query(t *testing.T, server netip.Addr, network, name string, qtype uint16) (*dns.Msg, error) {
	t.Helper()
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	var resp *dns.Msg
	err := netnsrun.In(b.ns, func() error {
		c := &dns.Client{Net: network, Timeout: 3 * time.Second}
		var err error
		resp, _, err = c.Exchange(m, net.JoinHostPort(server.String(), "53"))
		return err
	})
	return resp, err
}

func wantPrefix(t *testing.T, got, want string) {
	t.Helper()
	if !strings.HasPrefix(got, want) {
		t.Errorf("got %q, want prefix %q", got, want)
	}
}

func wantContains(t *testing.T, got, want string) {
	t.Helper()
	if !strings.Contains(got, want) {
		t.Errorf("got %q, want it to contain %q", got, want)
	}
}

// refusalsContain checks that the attachment recorded a refusal whose
// message contains want, and returns the messages.
func refusalsContain(t *testing.T, a *Attachment, want ...string) []string {
	t.Helper()
	var msgs []string
	for _, r := range a.Refusals() {
		msgs = append(msgs, r.String())
	}
	for _, w := range want {
		found := false
		for _, m := range msgs {
			found = found || strings.Contains(m, w)
		}
		if !found {
			t.Errorf("no refusal contains %q; refusals: %q", w, msgs)
		}
	}
	return msgs
}

func TestDefaultDeny(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-empty")
	if b.att.ResolvConf() != "" || len(b.att.Env()) != 0 || b.att.Addr().IsValid() {
		t.Errorf("empty policy got network config: %q %q %v", b.att.ResolvConf(), b.att.Env(), b.att.Addr())
	}
	wantPrefix(t, b.fetch(t, nil, "http://web.test/"), "ERR") // /etc/hosts says 10.77.K.3, unreachable
	wantPrefix(t, b.fetch(t, nil, "http://pypi.test/"), "ERR")
	wantPrefix(t, b.fetch(t, nil, "http://"+w.WebAddr.String()+"/"), "ERR")
	if _, err := b.query(t, w.gw.GatewayAddr(), "udp", "web.test", dns.TypeA); err == nil {
		t.Error("DNS answered in a box with an empty policy")
	}
	links, err := netlinkLinks(b.ns)
	if err != nil {
		t.Fatal(err)
	}
	if len(links) != 1 || links[0] != "lo" {
		t.Errorf("box links = %v, want only lo", links)
	}
}

func netlinkLinks(ns netns.NsHandle) ([]string, error) {
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return nil, err
	}
	var names []string
	for _, l := range links {
		names = append(names, l.Attrs().Name)
	}
	return names, nil
}

func TestAllowedTransparent(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-web", "web.test", "pypi.test")

	// The box's /etc/hosts points web.test at the internal host; the
	// gateway reads Host/SNI and resolves web.test itself.
	wantPrefix(t, b.fetch(t, nil, "http://web.test/hello"), "OK 200 web:web.test/hello")
	wantPrefix(t, b.fetch(t, nil, "https://web.test/tls"), "OK 200 web:web.test/tls")
	// pypi.test is not in the box's hosts file: the box resolves it
	// through the gateway's DNS.
	wantPrefix(t, b.fetch(t, nil, "https://pypi.test/x"), "HTTP 404")
	out, code := b.curl(t, nil, "https://web.test/curl")
	if code != 0 || out != "web:web.test/curl" {
		t.Errorf("curl https: %d %q", code, out)
	}
	if r := b.att.Refusals(); len(r) != 0 {
		t.Errorf("refusals for allowed traffic: %v", r)
	}
	logs := w.logs.String()
	for _, want := range []string{`"session":"s-web"`, `"via":"tls"`, `"via":"http"`, `"name":"web.test"`, `"addr":"` + w.WebAddr.String() + `"`, `"verdict":"allow"`} {
		wantContains(t, logs, want)
	}
}

func TestRefusedNames(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-refuse", "web.test", "meta.test", "loop.test", "internal.test", "rebind.test")

	// A name outside the allowlist: DNS refuses it, and a connection
	// that names it anyway (curl --resolve skips DNS) is refused.
	wantPrefix(t, b.fetch(t, nil, "http://other.test/"), "ERR")
	out, _ := b.curl(t, nil, "--resolve", "other.test:80:"+w.WebAddr.String(), "http://other.test/")
	wantContains(t, out, "connection to other.test:80 refused by policy: not in the allowlist")
	_, code := b.curl(t, nil, "--resolve", "other.test:443:"+w.WebAddr.String(), "https://other.test/")
	if code == 0 {
		t.Error("https to a name outside the allowlist succeeded")
	}

	// Allowed names that resolve to internal addresses.
	for _, tt := range []struct{ name, addr, why string }{
		{"meta.test", "169.254.169.254", "link-local"},
		{"loop.test", "127.0.0.1", "loopback"},
		{"internal.test", w.IntAddr.String(), "private"},
		{"rebind.test", "169.254.169.254", "link-local"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			out, _ := b.curl(t, nil, "--resolve", tt.name+":80:"+w.WebAddr.String(), "http://"+tt.name+"/")
			wantContains(t, out, "connection to "+tt.name+":80 refused by policy: "+tt.name+" resolves only to blocked addresses ("+tt.addr+" is "+tt.why)
			_, code := b.curl(t, nil, "--resolve", tt.name+":443:"+w.WebAddr.String(), "https://"+tt.name+"/")
			if code == 0 {
				t.Error("https succeeded")
			}
			resp, err := b.query(t, w.gw.GatewayAddr(), "udp", tt.name, dns.TypeA)
			if err != nil || resp.Rcode != dns.RcodeRefused {
				t.Errorf("DNS A %s: %v %v", tt.name, resp, err)
			}
			refusalsContain(t, b.att, "connection to "+tt.name+":80 refused", "connection to "+tt.name+":443 refused", "DNS lookup of "+tt.name+" refused")
		})
	}
	// The internal host really is up: the refusal is policy, not luck.
	resp, err := http.Get("http://" + w.IntAddr.String() + "/")
	if err != nil {
		t.Fatalf("internal host not reachable from the host: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "internal" {
		t.Errorf("internal host says %q", body)
	}
	logs := w.logs.String()
	for _, want := range []string{`"session":"s-refuse"`, `"verdict":"refuse"`, `"name":"meta.test"`, `"addr":"169.254.169.254"`} {
		wantContains(t, logs, want)
	}
}

// TestDirectIPAndRawTraffic runs twice: with the box's own firewall, and
// without it, as for a box whose traffic never meets its namespace's
// netfilter (gVisor's netstack sends raw frames) or one that removed it:
// the gateway's own rules must then hold the box alone.
func TestDirectIPAndRawTraffic(t *testing.T) {
	for _, own := range []bool{true, false} {
		t.Run(map[bool]string{true: "box firewall", false: "gateway alone"}[own], func(t *testing.T) {
			w := newWorld(t)
			b := w.newBox(t, "s-raw", "web.test")
			if !own {
				if out, err := b.exec(t, nil, "nft", "delete", "table", "inet", boxTable); err != nil {
					t.Fatalf("removing the box's firewall: %v %s", err, out)
				}
				// Transparent HTTP still reaches the allowed name, through
				// the gateway's DNAT, whatever address the box dialed.
				out, _ := b.curl(t, nil, "--resolve", "web.test:80:192.0.2.9", "http://web.test/direct")
				wantPrefix(t, out, "web:web.test/direct")
			}
			directIPAndRawTraffic(t, w, b)
		})
	}
}

func directIPAndRawTraffic(t *testing.T, w *world, b *box) {
	web := w.WebAddr.String()

	out, _ := b.curl(t, nil, "http://"+web+"/")
	wantContains(t, out, "refused by policy: connecting by IP address is not allowed")
	_, code := b.curl(t, nil, "-k", "https://"+web+"/")
	if code == 0 {
		t.Error("https to the allowed host's IP succeeded")
	}
	refusalsContain(t, b.att, "connection to "+web+":80 refused", "connection to port 443 refused by policy: cannot read the destination host name")

	// TCP to a port outside the policy is reset (by the box's firewall,
	// or the gateway's).
	_, code = b.curl(t, nil, "http://web.test:8080/")
	if code != 7 { // couldn't connect
		t.Errorf("curl to port 8080: exit %d, want 7 (connection refused)", code)
	}
	// An allowed name on a port it is not allowed on is refused by the
	// gateway too (port 80 is allowed for web.test only).
	out, _ = b.curl(t, nil, "--resolve", "x.test:80:"+web, "http://x.test/")
	wantContains(t, out, "refused by policy")

	// UDP other than DNS to the gateway, and ICMP, go nowhere.
	probe := fmt.Sprintf(`
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
try:
    s.sendto(b"hi", (%q, %d)); s.recvfrom(100); print("UDP-REPLY")
except OSError as e:
    print("UDP-BLOCKED", e)
try:
    s.sendto(b"hi", ("10.201.0.1", 123)); s.recvfrom(100); print("UDP-GW-REPLY")
except OSError as e:
    print("UDP-GW-BLOCKED", e)
r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); r.settimeout(3)
pkt = struct.pack("!BBHHH", 8, 0, 0, 1, 1) + b"kiln"
c = sum(struct.unpack("!%%dH" %% (len(pkt)//2), pkt)); c = (c >> 16) + (c & 0xffff); c = ~(c + (c >> 16)) & 0xffff
pkt = pkt[:2] + struct.pack("!H", c) + pkt[4:]
try:
    r.sendto(pkt, (%q, 0))
    while True:
        data, _ = r.recvfrom(1500)
        if data[20] == 0: print("ICMP-REPLY"); break
except OSError as e:
    print("ICMP-BLOCKED", e)
`, web, w.UDPEcho.Port(), web)
	out, err := b.exec(t, nil, w.python, "-c", probe)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"UDP-BLOCKED", "UDP-GW-BLOCKED", "ICMP-BLOCKED"} {
		wantContains(t, out, want)
	}
	if n := w.UDPHits.Load(); n != 0 {
		t.Errorf("UDP echo server got %d packets from the box", n)
	}
}

func TestDNS(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-dns", "web.test", "*.wild.test")
	gw := w.gw.GatewayAddr()
	for _, network := range []string{"udp", "tcp"} {
		t.Run(network, func(t *testing.T) {
			resp, err := b.query(t, gw, network, "WEB.test", dns.TypeA)
			if err != nil || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
				t.Fatalf("A web.test: %v %v", resp, err)
			}
			if a := resp.Answer[0].(*dns.A).A.String(); a != w.WebAddr.String() {
				t.Errorf("web.test A = %s", a)
			}
			resp, err = b.query(t, gw, network, "web.test", dns.TypeAAAA)
			if err != nil || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 0 {
				t.Errorf("AAAA web.test: %v %v", resp, err)
			}
			for _, q := range []struct {
				name string
				typ  uint16
			}{
				{"other.test", dns.TypeA}, {"exfil-6b696c6e.attacker.example", dns.TypeTXT}, {"example.com", dns.TypeA},
				{"wild.test", dns.TypeA}, {"web.test.evil.example", dns.TypeA}, {"10.in-addr.arpa", dns.TypePTR},
			} {
				resp, err := b.query(t, gw, network, q.name, q.typ)
				if err != nil || resp.Rcode != dns.RcodeRefused || len(resp.Answer) != 0 {
					t.Errorf("%s %s: %v %v, want REFUSED", q.name, dns.TypeToString[q.typ], resp, err)
				}
			}
		})
	}
	refusalsContain(t, b.att, "DNS lookup of other.test refused by policy", "DNS lookup of exfil-6b696c6e.attacker.example refused")
	// DNS to any other server is blocked by the box's firewall.
	if _, err := b.query(t, w.WebAddr, "udp", "web.test", dns.TypeA); err == nil {
		t.Error("DNS to a server other than the gateway got an answer")
	}
}

func TestProxyEnv(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-proxy", "web.test")
	env := b.att.Env()
	wantContains(t, strings.Join(env, " "), "HTTPS_PROXY=http://10.201.0.1:3128")
	wantPrefix(t, b.fetch(t, env, "http://web.test/plain"), "OK 200 web:web.test/plain")
	wantPrefix(t, b.fetch(t, env, "https://web.test/connect"), "OK 200 web:web.test/connect")
	out, _ := b.curl(t, env, "http://other.test/")
	wantContains(t, out, "connection to other.test:80 refused by policy")
	out, _ = b.curl(t, env, "-v", "https://meta.test/")
	wantContains(t, out, "403")
	out, _ = b.curl(t, env, "http://"+w.WebAddr.String()+"/")
	wantContains(t, out, "connecting by IP address is not allowed")
	refusalsContain(t, b.att, "other.test:80 refused", "meta.test:443 refused", w.WebAddr.String()+":80 refused")
	wantContains(t, w.logs.String(), `"via":"connect"`)
	wantContains(t, w.logs.String(), `"via":"proxy"`)
}

func TestPipInstall(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-pip", "pypi.test")
	pip := []string{"-m", "pip", "--isolated", "--disable-pip-version-check", "--no-cache-dir", "--retries", "0", "--timeout", "20"}
	index := []string{"--index-url", "http://pypi.test/simple/", "--trusted-host", "pypi.test"}
	tlsIndex := []string{"--index-url", "https://pypi.test/simple/", "--cert", w.CAFile}

	// Plain HTTP, transparent: no proxy settings at all.
	dl := t.TempDir()
	out, err := b.exec(t, nil, w.python, append(append(append(pip, "download"), index...), "-d", dl, "kilnprobe")...)
	if err != nil {
		t.Fatalf("pip download: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dl, "kilnprobe-0.1-py3-none-any.whl")); err != nil {
		t.Error(err)
	}
	// HTTPS through HTTPS_PROXY (CONNECT), installing and importing.
	target := t.TempDir()
	out, err = b.exec(t, b.att.Env(), w.python, append(append(append(pip, "install"), tlsIndex...), "--target", target, "kilnprobe")...)
	if err != nil {
		t.Fatalf("pip install: %v\n%s", err, out)
	}
	out, err = b.exec(t, []string{"PYTHONPATH=" + target}, w.python, "-c", "import kilnprobe; print(kilnprobe.VALUE)")
	if err != nil || strings.TrimSpace(out) != "kiln-probe-ok" {
		t.Errorf("import kilnprobe: %v %q", err, out)
	}
	// An index the policy does not allow fails plainly.
	out, err = b.exec(t, b.att.Env(), w.python, append(append(pip, "download", "--index-url", "http://web.test/simple/", "--trusted-host", "web.test", "-d", t.TempDir()), "kilnprobe")...)
	if err == nil {
		t.Errorf("pip from a host outside the policy succeeded:\n%s", out)
	}
	refusalsContain(t, b.att, "connection to web.test:80 refused by policy")
}

func TestManyBoxesAndClose(t *testing.T) {
	w := newWorld(t)
	var boxes [3]*box
	var wg sync.WaitGroup
	policies := [][]string{{"web.test"}, {"pypi.test"}, {"web.test:443"}}
	for i := range boxes {
		boxes[i] = w.newBox(t, fmt.Sprintf("s-many-%d", i), policies[i]...)
	}
	results := make([][2]string, len(boxes))
	for i, b := range boxes {
		wg.Go(func() {
			out1, _ := b.curl(t, nil, "http://web.test/x")
			out2, _ := b.curl(t, nil, "--resolve", "pypi.test:80:"+w.WebAddr.String(), "http://pypi.test/simple/kilnprobe/")
			results[i] = [2]string{out1, out2}
		})
	}
	wg.Wait()
	if results[0][0] != "web:web.test/x" || !strings.Contains(results[0][1], "refused by policy") {
		t.Errorf("box 0 (web.test): %q", results[0])
	}
	if !strings.Contains(results[1][0], "refused by policy") || !strings.Contains(results[1][1], "kilnprobe") {
		t.Errorf("box 1 (pypi.test): %q", results[1])
	}
	if results[2][0] == "web:web.test/x" || results[2][1] == "" {
		t.Errorf("box 2 (web.test:443 only) reached port 80: %q", results[2])
	}
	if boxes[0].att.Addr() == boxes[1].att.Addr() {
		t.Error("two boxes share an address")
	}

	// Closing one box cuts it off and removes its veth and rules; the
	// others keep working.
	b := boxes[0]
	if err := b.att.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.att.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	links, err := netlinkLinks(b.ns)
	if err != nil {
		t.Fatal(err)
	}
	if len(links) != 1 || links[0] != "lo" {
		t.Errorf("after Close box links = %v, want only lo", links)
	}
	out, err := b.exec(t, nil, "nft", "list", "ruleset")
	if err != nil || strings.Contains(out, boxTable) {
		t.Errorf("box firewall left behind:\n%s", out)
	}
	wantPrefix(t, b.fetch(t, nil, "http://web.test/"), "ERR")
	out, code := boxes[1].curl(t, nil, "http://pypi.test/simple/kilnprobe/")
	if code != 0 || !strings.Contains(out, "kilnprobe") {
		t.Errorf("box 1 after box 0 closed: %d %q", code, out)
	}
	gwLinks, err := netlinkLinks(w.gw.ns)
	if err != nil {
		t.Fatal(err)
	}
	if len(gwLinks) != 3 { // lo and two boxes' veths
		t.Errorf("gateway links after one Close: %v", gwLinks)
	}
}

// TestBoxCannotSpoofAnotherBox checks that the gateway attributes traffic
// by the veth it arrives on: a box that sends from another box's address
// gets no reply (reverse-path filtering in the gateway namespace).
func TestBoxCannotSpoofAnotherBox(t *testing.T) {
	w := newWorld(t)
	victim := w.newBox(t, "s-victim", "pypi.test")
	attacker := w.newBox(t, "s-attacker", "web.test")
	// The attacker's own policy refuses pypi.test. (This also settles the
	// attacker's neighbour entry for the gateway: an ARP request sent
	// from the spoofed address gets no answer either.)
	out0, _ := attacker.curl(t, nil, "--resolve", "pypi.test:80:"+w.WebAddr.String(), "http://pypi.test/simple/kilnprobe/")
	wantContains(t, out0, "refused by policy")
	// Give the attacker the victim's address too and send from it.
	h, err := netlink.NewHandleAt(attacker.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.AddrAdd(eth, &netlink.Addr{IPNet: hostNet(victim.att.Addr())}); err != nil {
		t.Fatal(err)
	}
	out, code := attacker.curl(t, nil, "--interface", victim.att.Addr().String(), "--connect-timeout", "3",
		"--resolve", "pypi.test:80:"+w.WebAddr.String(), "http://pypi.test/simple/kilnprobe/")
	if strings.Contains(out, "kilnprobe") || code == 0 {
		t.Errorf("attacker reached pypi.test with the victim's address: %d %q", code, out)
	}
	if strings.Contains(w.logs.String(), `"session":"s-victim","via"`) {
		t.Error("the gateway attributed the attacker's traffic to the victim")
	}
	// Back on its own address, the attacker is still refused.
	if err := h.AddrDel(eth, &netlink.Addr{IPNet: hostNet(victim.att.Addr())}); err != nil {
		t.Fatal(err)
	}
	out, _ = attacker.curl(t, nil, "--resolve", "pypi.test:80:"+w.WebAddr.String(), "http://pypi.test/simple/kilnprobe/")
	wantContains(t, out, "refused by policy")
}

// BenchmarkAttach measures wiring a fresh box namespace to the gateway and
// removing it again: the network cost of a per-call box.
func BenchmarkAttach(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("skipping: needs root to create network namespaces")
	}
	gw, err := NewGateway(Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer gw.Close()
	policy := MustParsePolicy("pypi.org", "*.pythonhosted.org")
	var attach, detach time.Duration
	for b.Loop() {
		ns, err := netnsrun.New()
		if err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		a, err := gw.attachNS(context.Background(), ns, BoxInfo{Session: "bench", Policy: policy})
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := a.Close(); err != nil {
			b.Fatal(err)
		}
		attach += t1.Sub(t0)
		detach += time.Since(t1)
	}
	b.ReportMetric(float64(attach.Microseconds())/float64(b.N), "attach-µs/op")
	b.ReportMetric(float64(detach.Microseconds())/float64(b.N), "close-µs/op")
}
