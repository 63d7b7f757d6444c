package jail_test

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// TestEgressWiring checks that a jail under an allowlist gets the gateway's
// resolver and proxy, and that refusals reach the caller. The gateway's own
// allow paths (HTTP, SNI, pip) are tested in internal/egress.
func TestEgressWiring(t *testing.T) {
	newBackend(t) // skips without root
	gw, err := egress.NewGateway(egress.Options{Hosts: map[string][]netip.Addr{"loop.test": {netip.MustParseAddr("127.0.0.1")}}})
	if err != nil {
		t.Skipf("egress gateway unavailable: %v", err)
	}
	defer gw.Close()
	policy, err := egress.ParsePolicy("loop.test")
	if err != nil {
		t.Fatal(err)
	}
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Egress: gw, Policy: policy})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "egress"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	res, err := box.RunPython(ctx, `import os, socket, urllib.request
print("proxy", os.environ.get("HTTPS_PROXY"))
try:
    socket.getaddrinfo("elsewhere.test", 80); print("dns elsewhere OPEN")
except OSError: print("dns elsewhere refused")
try:
    urllib.request.urlopen("http://loop.test/", timeout=5); print("http OPEN")
except Exception as e: print("http refused", e)
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("192.0.2.1", 22)); print("raw OPEN")
except OSError: print("raw refused")`, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := res.Stdout.Text
	for _, want := range []string{"proxy http://", "dns elsewhere refused", "http refused", "raw refused"} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s%s", want, out, res.Stderr.Text)
		}
	}
	refusals := box.(sandbox.RefusalReporter).NetworkRefusals()
	joined := strings.Join(refusals, "\n")
	if !strings.Contains(joined, "elsewhere.test") || !strings.Contains(joined, "loop.test") {
		t.Errorf("refusals not reported: %q", refusals)
	}
}
