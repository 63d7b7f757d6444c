package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"kiln/internal/boxpolicy"
	"kiln/internal/egress"
	"kiln/internal/egress/egresstest"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
)

// webBody starts every page of the local internet's web host (egresstest).
const webBody = "web:"

// newEgressWorld is a local internet (egresstest) and a gateway that
// resolves its names (web.test and other.test are the web host) and may
// dial its web host.
func newEgressWorld(t testing.TB, secrets ...egress.Secret) (web netip.Addr, gw *egress.Gateway) {
	t.Helper()
	in, gw := newEgressInternet(t, secrets...)
	return in.WebAddr, gw
}

// newEgressInternet is newEgressWorld with the local internet itself,
// whose web host reports what its /echo received.
func newEgressInternet(t testing.TB, secrets ...egress.Secret) (*egresstest.Internet, *egress.Gateway) {
	t.Helper()
	in := egresstest.New(t)
	var log *slog.Logger
	if testing.Verbose() {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil)) // "egress attached" names each box's address
	}
	gw, err := egress.NewGateway(egress.Options{
		Logger:               log,
		HostsFile:            in.HostsFile,
		Hosts:                in.Hosts,
		TestOnlyAllowedAddrs: in.Allowed(),
		Resolver:             in.Upstream.Resolver(),
		UpstreamRoots:        in.Roots(),
		Secrets:              secrets,
	})
	if err != nil {
		t.Skipf("skipping: the egress gateway cannot start here: %v", err)
	}
	t.Cleanup(func() { gw.Close() })
	return in, gw
}

func allowedPolicy(t testing.TB) egress.Policy {
	p, err := egress.ParsePolicy("web.test")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// netProbe is what a box sees of its network, as JSON: the allowed host
// through HTTP_PROXY and transparently, a denied name, the web host by its
// address (which it must not reach however it asks), DNS, and the address
// the box's netstack sends from.
const netProbe = `import json, os, socket, urllib.request
def get(url, proxy=True):
    h = urllib.request.ProxyHandler() if proxy else urllib.request.ProxyHandler({})
    try:
        return urllib.request.build_opener(h).open(url, timeout=15).read().decode()
    except Exception as e:
        return "ERR " + repr(e)
out = {"proxy_env": os.environ.get("HTTPS_PROXY", ""), "resolv": open("/etc/resolv.conf").read()}
out["ifaces"] = sorted(n for _, n in socket.if_nameindex())
out["proxy"] = get("http://web.test/")
out["transparent"] = get("http://web.test/", proxy=False)
out["denied"] = get("http://other.test/")
out["direct"] = get("http://WEB/", proxy=False)
try:
    s = socket.create_connection(("WEB", 80), timeout=5)
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    out["raw"] = s.recv(4096).decode(errors="replace")
except OSError as e:
    out["raw"] = "ERR " + repr(e)
try:
    socket.create_connection(("WEB", 22), timeout=5); out["port22"] = "OPEN"
except OSError as e:
    out["port22"] = "ERR " + repr(e)
try:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(3)
    u.sendto(b"x", ("WEB", 9999)); u.recv(16); out["udp"] = "OPEN"
except OSError as e:
    out["udp"] = "ERR " + repr(e)
try:
    socket.getaddrinfo("other.test", 80); out["dns_denied"] = "OPEN"
except OSError:
    out["dns_denied"] = "refused"
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(("GW", 53)); out["addr"] = s.getsockname()[0]
except OSError as e:
    out["addr"] = "ERR " + repr(e)
print(json.dumps(out))
`

type netView struct {
	ProxyEnv    string   `json:"proxy_env"`
	Resolv      string   `json:"resolv"`
	Ifaces      []string `json:"ifaces"`
	Proxy       string   `json:"proxy"`
	Transparent string   `json:"transparent"`
	Denied      string   `json:"denied"`
	Direct      string   `json:"direct"`
	Raw         string   `json:"raw"`
	Port22      string   `json:"port22"`
	UDP         string   `json:"udp"`
	DNSDenied   string   `json:"dns_denied"`
	Addr        string   `json:"addr"`
}

func probeNet(t *testing.T, sb sandbox.Sandbox, web, gw netip.Addr) netView {
	t.Helper()
	code := strings.NewReplacer("WEB", web.String(), "GW", gw.String()).Replace(netProbe)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := sb.RunPython(ctx, code, sandbox.ExecOptions{})
	if err != nil {
		t.Fatalf("RunPython: %v", err)
	}
	var v netView
	if err := json.Unmarshal([]byte(strings.TrimSpace(res.Stdout.Text)), &v); err != nil {
		t.Fatalf("probe output %q (%s): %v", res.Stdout.Text, res.Stderr.Text, err)
	}
	t.Logf("the box's view: %+v", v)
	return v
}

// checkPoliced checks a box's view under the web.test policy, and
// that its refusals reach the caller through its own attachment.
func checkPoliced(t *testing.T, sb sandbox.Sandbox, v netView, web netip.Addr) {
	t.Helper()
	if !strings.Contains(v.Proxy, webBody) || !strings.Contains(v.Transparent, webBody) {
		t.Errorf("web.test not reached: through the proxy %q, transparently %q", v.Proxy, v.Transparent)
	}
	for what, got := range map[string]string{"other.test": v.Denied, "the web host by address": v.Direct, "raw TCP to the web host": v.Raw} {
		if strings.Contains(got, webBody) {
			t.Errorf("%s reached the web host: %q", what, got)
		}
	}
	if !strings.HasPrefix(v.Port22, "ERR ") || !strings.HasPrefix(v.UDP, "ERR ") {
		t.Errorf("a port the policy does not allow: TCP %q, UDP %q, want errors", v.Port22, v.UDP)
	}
	if v.DNSDenied != "refused" {
		t.Errorf("DNS of other.test: %s", v.DNSDenied)
	}
	if !strings.HasPrefix(v.ProxyEnv, "http://") || !strings.Contains(v.Resolv, "nameserver ") {
		t.Errorf("box not pointed at the gateway: HTTPS_PROXY %q, resolv.conf %q", v.ProxyEnv, v.Resolv)
	}
	att := sb.(*gvBox).bx.egress
	if att == nil || v.Addr != att.Addr().String() {
		t.Errorf("the box sends from %s; its attachment has %v", v.Addr, att.Addr())
	}
	refusals := strings.Join(sb.(sandbox.RefusalReporter).NetworkRefusals(), "\n")
	for _, want := range []string{"other.test", "IP address"} {
		if !strings.Contains(refusals, want) {
			t.Errorf("refusals do not mention %q:\n%s", want, refusals)
		}
	}
}

// TestEgress: a cold box under a policy reaches the allowed host through
// the gateway (HTTP_PROXY and transparently), never a denied name or the
// same server by its address, sends from the address the gateway gave it,
// and its refusals reach the caller.
func TestEgress(t *testing.T) {
	testRunsc(t) // skips without root or runsc
	web, gw := newEgressWorld(t)
	b := newTestBackend(t, Options{Cold: true, Egress: gw, Policy: allowedPolicy(t)})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sb, err := b.Create(ctx, sandbox.Spec{ID: "egress-cold"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	v := probeNet(t, sb, web, gw.GatewayAddr())
	checkPoliced(t, sb, v, web)
	if !slices.Equal(v.Ifaces, []string{"eth0", "lo"}) {
		t.Errorf("interfaces %v, want eth0 and lo", v.Ifaces)
	}
}

// TestEgressBattery is the egress battery every networked backend runs.
func TestEgressBattery(t *testing.T) {
	testRunsc(t) // skips without root or runsc
	agent := sandboxtest.BuildAgent(t)
	sandboxtest.Egress(t, func(t *testing.T, gw *egress.Gateway, policy egress.Policy) sandbox.Backend {
		return newTestBackend(t, Options{Cold: true, Agent: agent, Egress: gw, Policy: policy})
	})
}

// TestEgressSecretTrust: with a secret for an allowed host, a box gets
// the gateway's CA bundle at boxpolicy.TrustBundle and the variables that
// point TLS clients at it, and sees the secret's placeholder, never its
// value. Its HTTPS request to that host carries the value when it reaches
// the host, and the value appears nowhere the box can read: any
// process's environment, its files, its own memory, the echo
// (sandboxtest.SecretSearchPy).
func TestEgressSecretTrust(t *testing.T) {
	testRunsc(t)
	file := filepath.Join(t.TempDir(), "token")
	const value = "kiln-canary-7f3a0b1c2d3e4f50"
	if err := os.WriteFile(file, []byte(value+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	sec, err := egress.ParseSecret("API_TOKEN@web.test=file:" + file)
	if err != nil {
		t.Fatal(err)
	}
	in, gw := newEgressInternet(t, sec)
	b := newTestBackend(t, Options{Cold: true, Egress: gw, Policy: allowedPolicy(t)})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sb, err := b.Create(ctx, sandbox.Spec{ID: "egress-secret"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	sandboxtest.SecretSearchControl(t, ctx, sb)
	out := run(t, sb, `import os, re, urllib.request
b = open("`+boxpolicy.TrustBundle+`").read()
print("certs", b.count("BEGIN CERTIFICATE") > 0)
print("ssl", os.environ.get("SSL_CERT_FILE"))
tok = os.environ.get("API_TOKEN")
print("token", tok)
req = urllib.request.Request("https://web.test/echo", headers={"Authorization": "Bearer " + tok})
with urllib.request.urlopen(req, timeout=20) as r:
    print("status", r.status, "body", r.read().decode().strip())
`+sandboxtest.SecretSearchPy)
	want := bx(sb).egress.TrustBundle()
	if len(want) == 0 {
		t.Fatal("control: the attachment has no trust bundle though its policy allows a secret's host")
	}
	if strings.Contains(out, value) {
		t.Errorf("the value reached the box:\n%s", out)
	}
	if got := in.Served(); !slices.Equal(got, []string{"web.test auth=Bearer " + value + " key="}) {
		t.Errorf("web.test received %q, want the value; the box said:\n%s", got, out)
	}
	ph := sec.Placeholder()
	for _, w := range []string{"certs True", "ssl " + boxpolicy.TrustBundle, "token " + ph,
		"status 200 body echo web.test auth=Bearer " + ph, "found []"} {
		if !strings.Contains(out, w) {
			t.Errorf("missing %q in:\n%s", w, out)
		}
	}
}

func bx(sb sandbox.Sandbox) *box { return sb.(*gvBox).bx }

// TestEgressNoPolicy: with a gateway but an empty policy, and with no
// gateway, a box has loopback only and reaches nothing.
func TestEgressNoPolicy(t *testing.T) {
	testRunsc(t)
	web, gw := newEgressWorld(t)
	for name, opts := range map[string]Options{
		"empty policy": {Cold: true, Egress: gw},
		"no gateway":   {Cold: true},
	} {
		t.Run(strings.ReplaceAll(name, " ", "-"), func(t *testing.T) {
			b := newTestBackend(t, opts)
			if got := b.network(); got != "none" {
				t.Errorf("runsc --network=%s, want none", got)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			sb, err := b.Create(ctx, sandbox.Spec{ID: "egress-none"})
			if err != nil {
				t.Fatal(err)
			}
			defer sb.Close()
			v := probeNet(t, sb, web, gw.GatewayAddr())
			if !slices.Equal(v.Ifaces, []string{"lo"}) {
				t.Errorf("interfaces %v, want lo only", v.Ifaces)
			}
			for what, got := range map[string]string{"web.test": v.Transparent, "the web host": v.Direct, "raw TCP": v.Raw} {
				if !strings.HasPrefix(got, "ERR ") {
					t.Errorf("%s without a policy: %q, want an error", what, got)
				}
			}
			if !strings.HasPrefix(v.Addr, "ERR ") {
				t.Errorf("a box without a policy has an address towards the gateway: %s", v.Addr)
			}
			if r := sb.(sandbox.RefusalReporter).NetworkRefusals(); len(r) != 0 {
				t.Errorf("refusals without a policy: %q", r)
			}
		})
	}
}

// TestEgressRestore is the warm start under a policy: a box restored from
// the template's checkpoint (which holds the template box's NIC and
// address) runs with the address of its own fresh attachment, which the
// gateway knows, and the rules hold; two restored boxes do not share one.
// A state-level snapshot restored into a new box (fork, hibernation) gets
// that box's attachment too.
func TestEgressRestore(t *testing.T) {
	testRunsc(t)
	web, gw := newEgressWorld(t)
	b := newTestBackend(t, Options{Egress: gw, Policy: allowedPolicy(t)})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	spec := sandbox.Spec{ID: "egress-warm"}
	if err := b.Warm(ctx, spec); err != nil {
		t.Fatal(err)
	}
	var addrs []string
	var boxes []sandbox.Sandbox
	for i := range 2 {
		spec.ID = fmt.Sprintf("egress-warm-%d", i)
		sb, err := b.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		defer sb.Close()
		if args := sb.(*gvBox).bx.cmd.Args; !slices.Contains(args, "restore") {
			t.Fatalf("box %d was not restored: %v", i, args)
		}
		v := probeNet(t, sb, web, gw.GatewayAddr())
		checkPoliced(t, sb, v, web)
		addrs = append(addrs, v.Addr)
		boxes = append(boxes, sb)
	}
	if addrs[0] == addrs[1] {
		t.Errorf("two restored boxes send from one address, %s", addrs[0])
	}

	// A state snapshot of the first box, loaded into a new box.
	if _, err := boxes[0].RunPython(ctx, "kept = 41", sandbox.ExecOptions{}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if _, err := boxes[0].(sandbox.Snapshotter).Snapshot(ctx, dir); err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	boxes[0].Close()
	spec.ID = "egress-fork"
	fork, err := sandbox.Restore(ctx, b, spec, dir)
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	defer fork.Close()
	if got := run(t, fork, "print(kept + 1)"); strings.TrimSpace(got) != "42" {
		t.Errorf("restored state: %q", got)
	}
	checkPoliced(t, fork, probeNet(t, fork, web, gw.GatewayAddr()), web)
}

// BenchmarkCreateEgress is what a box's network costs at creation: a cold
// box created, run once and destroyed, without a policy and with one (a
// namespace, veth and nftables table from the gateway, runsc
// --network=sandbox).
//
//	go test ./internal/sandbox/gvisor -run '^$' -bench CreateEgress -benchtime 10x
func BenchmarkCreateEgress(b *testing.B) {
	testRunsc(b)
	_, gw := newEgressWorld(b)
	for _, mode := range []string{"none", "policy"} {
		b.Run(mode, func(b *testing.B) {
			opts := Options{Cold: true}
			if mode == "policy" {
				opts.Egress, opts.Policy = gw, allowedPolicy(b)
			}
			be := newTestBackend(b, opts)
			ctx := context.Background()
			i := 0
			for b.Loop() {
				i++
				sb, err := be.Create(ctx, sandbox.Spec{ID: fmt.Sprintf("bench-net-%d", i)})
				if err != nil {
					b.Fatal(err)
				}
				if got := run(b, sb, "print(2+2)"); strings.TrimSpace(got) != "4" {
					b.Fatalf("print(2+2) = %q", got)
				}
				sb.Close()
			}
		})
	}
}

// TestEgressImageRoot: an image root without /etc/resolv.conf to bind the
// gateway's onto is refused when the backend has a policy (kiln does not
// write into an operator's image), and accepted once the file is there.
func TestEgressImageRoot(t *testing.T) {
	runsc := testRunsc(t)
	_, gw := newEgressWorld(t)
	root := t.TempDir()
	opts := Options{Runsc: runsc, Agent: testAgent(t), StateDir: t.TempDir(), Rootfs: root, Egress: gw, Policy: allowedPolicy(t)}
	if b, err := New(opts); err == nil {
		b.Close()
		t.Fatal("an image root without /etc/resolv.conf was accepted")
	} else if !strings.Contains(err.Error(), "/etc/resolv.conf") {
		t.Errorf("refusal does not name the file: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "etc")); err == nil {
		t.Errorf("New wrote into the image root")
	}
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc", "resolv.conf"), nil, 0o644)
	b, err := New(opts)
	if err != nil {
		t.Fatalf("an image root with /etc/resolv.conf: %v", err)
	}
	b.Close()
}

// TestEgressNetNotTaken: a box whose namespace's eth0 still has its
// address (runsc never read that namespace, so its netstack runs with some
// other network) is refused before it is handed out; one runsc took over
// passes.
func TestEgressNetNotTaken(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root for network namespaces")
	}
	_, gw := newEgressWorld(t)
	att, path, err := gw.AttachNetNS(context.Background(), egress.BoxInfo{Session: "s", Policy: allowedPolicy(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer att.Close()
	b := &box{egress: att, netns: path}
	if err := b.checkNetTaken(); !errors.Is(err, errNetNotTaken) {
		t.Fatalf("an untouched namespace: %v, want errNetNotTaken", err)
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	addrs, _ := h.AddrList(eth, netlink.FAMILY_V4)
	for _, a := range addrs {
		if err := h.AddrDel(eth, &a); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.checkNetTaken(); err != nil {
		t.Errorf("a namespace stripped as runsc strips it: %v", err)
	}
	if err := (&box{}).checkNetTaken(); err != nil {
		t.Errorf("a box without network: %v", err)
	}
}
