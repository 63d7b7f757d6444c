package jail_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// webHost is an HTTPS server for name in a network namespace of the
// test's own, reached from the host over a veth: it answers every request
// with the Authorization header it got, and appends that header to the
// file it returns.
func webHost(t *testing.T, name string) (addr netip.Addr, roots *x509.CertPool, log string) {
	t.Helper()
	for _, tool := range []string{"ip", "python3"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: needs %s", tool)
		}
	}
	k := 20 + os.Getpid()%200
	ns, hostIf := fmt.Sprintf("kjs%d", os.Getpid()), fmt.Sprintf("kjsv%d", os.Getpid())
	hostAddr, addr := fmt.Sprintf("10.78.%d.1/24", k), netip.AddrFrom4([4]byte{10, 78, byte(k), 2})
	sh := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	sh("ip", "netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	sh("ip", "link", "add", hostIf, "type", "veth", "peer", "name", "eth0", "netns", ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", hostIf).Run() })
	sh("ip", "addr", "add", hostAddr, "dev", hostIf)
	sh("ip", "link", "set", hostIf, "up")
	sh("ip", "-n", ns, "addr", "add", addr.String()+"/24", "dev", "eth0")
	sh("ip", "-n", ns, "link", "set", "eth0", "up")
	sh("ip", "-n", ns, "link", "set", "lo", "up")

	dir := t.TempDir()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalECPrivateKey(key)
	os.WriteFile(filepath.Join(dir, "cert.pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	os.WriteFile(filepath.Join(dir, "key.pem"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600)
	cert, _ := x509.ParseCertificate(der)
	roots = x509.NewCertPool()
	roots.AddCert(cert)
	log = filepath.Join(dir, "received")
	server := `import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        got = self.headers.get("Authorization", "")
        with open(sys.argv[3], "a") as f: f.write(got + "\n")
        body = ("echo " + got + "\n").encode()
        self.send_response(200); self.send_header("X-Echo", got); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
srv = http.server.HTTPServer((sys.argv[4], 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[1], sys.argv[2])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print("ready", flush=True)
srv.serve_forever()`
	cmd := exec.Command("ip", "netns", "exec", ns, "python3", "-c", server, filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem"), log, addr.String())
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("the web host did not start: %q %v", line, err)
	}
	return addr, roots, log
}

// TestEgressSecretNeverInTheBox: code in a jail with an egress secret uses
// the placeholder, the secret's host receives the value, and the code,
// searching everything it can reach (its environment and every process's,
// every file it can read but the host's read-only runtime, its own memory
// after the request), finds no
// trace of the value, though the server echoed it back.
func TestEgressSecretNeverInTheBox(t *testing.T) {
	newBackend(t) // skips without root
	addr, roots, received := webHost(t, "api.test")
	raw := make([]byte, 8)
	rand.Read(raw)
	value := "kiln-canary-" + hex.EncodeToString(raw) // the box's search looks for kiln-canary- and 16 hex digits
	t.Setenv("KILN_TEST_JAIL_SECRET", value)
	secret, err := egress.ParseSecret("API_TOKEN@api.test=env:KILN_TEST_JAIL_SECRET")
	if err != nil {
		t.Fatal(err)
	}
	gw, err := egress.NewGateway(egress.Options{
		Hosts:                map[string][]netip.Addr{"api.test": {addr}},
		TestOnlyAllowedAddrs: []netip.Prefix{netip.PrefixFrom(addr, 32)},
		Secrets:              []egress.Secret{secret},
		UpstreamRoots:        roots,
	})
	if err != nil {
		t.Skipf("egress gateway unavailable: %v", err)
	}
	defer gw.Close()
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Egress: gw, Policy: egress.MustParsePolicy("api.test")})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "egress-secret"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	sandboxtest.SecretSearchControl(t, ctx, box)
	res, err := box.RunPython(ctx, `import os, re, urllib.request
tok = os.environ["API_TOKEN"]
print("placeholder", tok)
req = urllib.request.Request("https://api.test/echo", headers={"Authorization": "Bearer " + tok})
with urllib.request.urlopen(req, timeout=20) as r:
    print("status", r.status, "x-echo", r.headers["X-Echo"], "body", r.read().decode().strip())
`+sandboxtest.SecretSearchPy, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := res.Stdout.Text + res.Stderr.Text
	if strings.Contains(out, value) {
		t.Errorf("the value reached the box's output:\n%s", out)
	}
	got, _ := os.ReadFile(received)
	if strings.TrimSpace(string(got)) != "Bearer "+value {
		t.Fatalf("api.test received %q, want the value; box said:\n%s", got, out)
	}
	ph := secret.Placeholder()
	for _, want := range []string{"placeholder " + ph, "status 200 x-echo Bearer " + ph + " body echo Bearer " + ph, "found []"} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
}
