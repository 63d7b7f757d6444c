package microvm_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"kiln/internal/boxpolicy"
	"kiln/internal/egress"
	"kiln/internal/egress/egresstest"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/microvm"
	"kiln/internal/sandbox/sandboxtest"
)

// webHost serves HTTP on port 80 of an address of its own, in a network
// namespace reached from the host's over a veth: the gateway dials it
// from the host namespace, as it would a host on the internet. Every
// answer names the host the request was for.
func webHost(t *testing.T) netip.Addr {
	t.Helper()
	k := 20 + os.Getpid()%200
	addr := netip.AddrFrom4([4]byte{10, 79, byte(k), 2})
	hostAddr := netip.AddrFrom4([4]byte{10, 79, byte(k), 1})
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	web, err := netns.New() // the thread is in it now
	if err != nil {
		t.Skipf("skipping: cannot create a network namespace: %v", err)
	}
	t.Cleanup(func() { web.Close() })
	lo, _ := netlink.LinkByName("lo")
	netlink.LinkSetUp(lo)
	var ln net.Listener
	netns.Set(orig)
	hostIf := fmt.Sprintf("kmw%d", os.Getpid()%100000)
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostIf}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(web))}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("creating web veth: %v", err)
	}
	t.Cleanup(func() { netlink.LinkDel(veth) })
	mask := net.CIDRMask(24, 32)
	if err := netlink.AddrAdd(veth, &netlink.Addr{IPNet: &net.IPNet{IP: hostAddr.AsSlice(), Mask: mask}}); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(veth); err != nil {
		t.Fatal(err)
	}
	h, err := netlink.NewHandleAt(web)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.AddrAdd(eth, &netlink.Addr{IPNet: &net.IPNet{IP: addr.AsSlice(), Mask: mask}}); err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(eth); err != nil {
		t.Fatal(err)
	}
	if err := netns.Set(web); err != nil {
		t.Fatal(err)
	}
	ln, err = net.Listen("tcp4", net.JoinHostPort(addr.String(), "80"))
	netns.Set(orig)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from %s\n", r.Host)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return addr
}

// egressBackend is a TCG backend with opts whose VMs reach web.test (a
// webHost, whose address it returns too) through a gateway of their own.
func egressBackend(t *testing.T, opts microvm.Options) (*microvm.Backend, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: the egress gateway and a VM's tap need root")
	}
	web := webHost(t)
	gw, err := egress.NewGateway(egress.Options{
		Hosts:                map[string][]netip.Addr{"web.test": {web}, "internal.test": {netip.MustParseAddr("10.0.0.1")}},
		TestOnlyAllowedAddrs: []netip.Prefix{netip.PrefixFrom(web, 32)},
	})
	if err != nil {
		t.Skipf("skipping: egress gateway unavailable: %v", err)
	}
	t.Cleanup(func() { gw.Close() })
	opts.Egress, opts.Policy = gw, egress.MustParsePolicy("web.test")
	return newBackend(t, opts), web.String()
}

// probeNet is what the egress tests run in a box: the guest's devices and
// address, the proxy environment, an allowed name through the proxy and
// transparently, a denied name, a direct IP, and a name that resolves to
// a private address.
const probeNet = `import os, socket, fcntl, struct, urllib.request
print("devices", " ".join(sorted(os.listdir("/sys/class/net"))))
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", b"eth0"))  # SIOCGIFADDR
    print("addr", socket.inet_ntoa(a[20:24]))
except OSError as e:
    print("addr none", e)
print("proxy", os.environ.get("HTTPS_PROXY"))
print("resolv", open("/etc/resolv.conf").read().split("nameserver ")[-1].split()[0] if "nameserver" in open("/etc/resolv.conf").read() else "none")
def get(url, proxy):
    h = urllib.request.ProxyHandler() if proxy else urllib.request.ProxyHandler({})
    try:
        return urllib.request.build_opener(h).open(url, timeout=20).read().decode().strip()
    except Exception as e:
        return "refused " + type(e).__name__
print("via-proxy", get("http://web.test/", True))
print("transparent", get("http://web.test/", False))
print("denied", get("http://elsewhere.test/", True))
print("internal", get("http://internal.test/", False))
try:
    socket.getaddrinfo("elsewhere.test", 80); print("dns-denied OPEN")
except OSError: print("dns-denied refused")
c = socket.socket(); c.settimeout(10)
try:
    c.connect(("WEB", 80)); c.sendall(b"GET / HTTP/1.0\r\nHost: WEB\r\n\r\n"); d = c.recv(100)
    print("direct-ip", "OPEN" if b"hello" in d else "refused")
except OSError as e: print("direct-ip refused", e)
c = socket.socket(); c.settimeout(10)
try:
    c.connect(("192.0.2.1", 22)); print("raw OPEN")
except OSError: print("raw refused")
`

// checkNet runs probeNet in box and checks that it reaches web.test and
// nothing else, with want as its address; it returns the address.
func checkNet(t *testing.T, ctx context.Context, box sandbox.Sandbox, web string) string {
	t.Helper()
	res, err := box.RunPython(ctx, strings.ReplaceAll(probeNet, "WEB", web), sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := res.Stdout.Text
	if res.Error != nil {
		t.Fatalf("probe failed: %s\n%s%s", res.Error.Traceback, out, res.Stderr.Text)
	}
	lines := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		k, v, _ := strings.Cut(l, " ")
		lines[k] = v
	}
	for k, want := range map[string]string{
		"devices":     "eth0 lo",
		"via-proxy":   "hello from web.test",
		"transparent": "hello from web.test",
		"denied":      "refused HTTPError",
		"dns-denied":  "refused",
		"raw":         "refused",
	} {
		if lines[k] != want {
			t.Errorf("%s: %q, want %q\n%s", k, lines[k], want, out)
		}
	}
	for _, k := range []string{"internal", "direct-ip"} {
		if !strings.HasPrefix(lines[k], "refused") {
			t.Errorf("%s: %q, want refused\n%s", k, lines[k], out)
		}
	}
	if !strings.HasPrefix(lines["proxy"], "http://10.201.0.1:") || lines["resolv"] != "10.201.0.1" {
		t.Errorf("proxy %q, resolver %q: want the gateway's\n%s", lines["proxy"], lines["resolv"], out)
	}
	// The guest's address is its attachment's: the gateway knows the
	// box by it.
	if got, want := lines["addr"], box.(interface{ Addr() string }).Addr(); got != want {
		t.Errorf("guest eth0 has %q, its attachment %q", got, want)
	}
	return lines["addr"]
}

// TestEgress: a VM under a policy reaches an allowed host through the
// gateway, by its proxy and transparently, and nothing else; refusals
// reach the caller; every clone of the template gets an address of its
// own that the gateway gave it, and a box restored from a snapshot gets
// a fresh attachment too.
func TestEgress(t *testing.T) {
	b, web := egressBackend(t, microvm.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*testTimeout)
	defer cancel()
	box1, err := b.Create(ctx, sandbox.Spec{ID: "net1"})
	if err != nil {
		t.Fatal(err)
	}
	defer box1.Close()
	addr1 := checkNet(t, ctx, box1, web)
	refusals := strings.Join(box1.(sandbox.RefusalReporter).NetworkRefusals(), "\n")
	for _, name := range []string{"elsewhere.test", "internal.test"} {
		if !strings.Contains(refusals, name) {
			t.Errorf("refusal of %s not reported: %q", name, refusals)
		}
	}

	// A second clone of the same template, at the same time: its own
	// address.
	box2, err := b.Create(ctx, sandbox.Spec{ID: "net2"})
	if err != nil {
		t.Fatal(err)
	}
	defer box2.Close()
	if addr2 := checkNet(t, ctx, box2, web); addr2 == addr1 {
		t.Errorf("two clones share the address %s", addr1)
	}

	// A snapshot restored into a new box: a fresh attachment, and the
	// network works there.
	mustRun(t, ctx, box1, "x = 41")
	dir := t.TempDir()
	if _, err := box1.(sandbox.Snapshotter).Snapshot(ctx, dir); err != nil {
		t.Fatal(err)
	}
	box1.Close()
	box3, err := sandbox.Restore(ctx, b, sandbox.Spec{ID: "net3"}, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer box3.Close()
	if got := mustRun(t, ctx, box3, "print(x + 1)"); got != "42" {
		t.Errorf("restored state: %q", got)
	}
	if addr3 := checkNet(t, ctx, box3, web); addr3 == addr1 {
		t.Errorf("the restored box got its snapshot's box's address %s, freed a moment ago", addr1)
	}
}

// TestEgressColdBoot: a VM booted from scratch (no template) gets its
// attachment's address too, with a seed after its hello.
func TestEgressColdBoot(t *testing.T) {
	b, web := egressBackend(t, microvm.Options{ColdBoot: true})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "netcold"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	checkNet(t, ctx, box, web)
}

// TestEgressBattery is the egress battery every networked backend runs,
// on VMs under TCG.
func TestEgressBattery(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: the egress gateway and a VM's tap need root")
	}
	sandboxtest.Egress(t, func(t *testing.T, gw *egress.Gateway, policy egress.Policy) sandbox.Backend {
		return newBackend(t, microvm.Options{Egress: gw, Policy: policy})
	})
}

// TestNoNetworkDevice: without a policy the guest has loopback only, not
// even a network device.
func TestNoNetworkDevice(t *testing.T) {
	b := newBackend(t, microvm.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "nonet"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	if got := mustRun(t, ctx, box, `import os; print(" ".join(sorted(os.listdir("/sys/class/net"))))`); got != "lo" {
		t.Errorf("network devices of a VM without a policy: %q, want lo", got)
	}
	if _, ok := box.(sandbox.RefusalReporter); ok {
		t.Error("a box without a network reports refusals")
	}
}

// mustRun runs code in box and returns its stdout, trimmed; a failure
// fails the test.
func mustRun(t *testing.T, ctx context.Context, box sandbox.Sandbox, code string) string {
	t.Helper()
	res, err := box.RunPython(ctx, code, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Error != nil {
		t.Fatalf("%s: %s", code, res.Error.Traceback)
	}
	return strings.TrimSpace(res.Stdout.Text)
}

// TestEgressTrustBundle: with an egress secret, the guest gets the
// secret's placeholder (never its value), the gateway's trust bundle at
// boxpolicy.TrustBundle, read-only, and the variables that point TLS
// clients at it. Its HTTPS request to the secret's host carries the value
// when it reaches the host, and the value appears nowhere the guest can
// read: any process's environment, its files, its own memory, the echo
// (sandboxtest.SecretSearchPy).
func TestEgressTrustBundle(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: the egress gateway and a VM's tap need root")
	}
	const value = "kiln-canary-0f1e2d3c4b5a6978"
	t.Setenv("KILN_TEST_VM_SECRET", value)
	secret, err := egress.ParseSecret("API_TOKEN@api.test=env:KILN_TEST_VM_SECRET")
	if err != nil {
		t.Fatal(err)
	}
	in := egresstest.New(t)
	gw, err := egress.NewGateway(egress.Options{HostsFile: in.HostsFile, Hosts: in.Hosts,
		TestOnlyAllowedAddrs: in.Allowed(), Resolver: in.Upstream.Resolver(), UpstreamRoots: in.Roots(),
		Secrets: []egress.Secret{secret}})
	if err != nil {
		t.Skipf("skipping: egress gateway unavailable: %v", err)
	}
	defer gw.Close()
	b := newBackend(t, microvm.Options{Egress: gw, Policy: egress.MustParsePolicy("api.test")})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	box := create(t, b, sandbox.Spec{ID: "trust"})
	sandboxtest.SecretSearchControl(t, ctx, box)
	out := mustRun(t, ctx, box, `import os, re, urllib.request
p = os.environ.get("SSL_CERT_FILE", "")
pem = open(p).read() if p else ""
try:
    open(p, "a").write("x"); w = "writable"
except OSError: w = "read-only"
tok = os.environ.get("API_TOKEN", "")
print("bundle", p, pem.count("BEGIN CERTIFICATE") > 0, w)
print("placeholder", tok)
req = urllib.request.Request("https://api.test/echo", headers={"Authorization": "Bearer " + tok})
with urllib.request.urlopen(req, timeout=30) as r:
    print("status", r.status, "body", r.read().decode().strip())
`+sandboxtest.SecretSearchPy)
	if strings.Contains(out, value) {
		t.Errorf("the value reached the guest:\n%s", out)
	}
	if got := in.Served(); !slices.Equal(got, []string{"api.test auth=Bearer " + value + " key="}) {
		t.Errorf("api.test received %q, want the value; the guest said:\n%s", got, out)
	}
	ph := secret.Placeholder()
	for _, want := range []string{"bundle " + boxpolicy.TrustBundle + " True read-only", "placeholder " + ph,
		"status 200 body echo api.test auth=Bearer " + ph, "found []"} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
}
