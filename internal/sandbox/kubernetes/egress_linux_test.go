package kubernetes

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kiln/internal/boxpolicy"
	"kiln/internal/egress"
	"kiln/internal/egress/egresstest"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
)

// TestEgressBattery runs the one egress battery on box Pods: the gateway
// listens on the node's address on the Pods' bridge (where this test's
// kiln runs), the egress NetworkPolicy lets the boxes reach its DNS and
// proxy and nothing else, and kube-router enforces both policies. A Pod
// that could dial the local internet directly (no enforcement) fails the
// deny side, so an unenforced policy is a failure, not a pass.
func TestEgressBattery(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	addr := c.podGateway(t, ns)
	sandboxtest.EgressListening(t, addr, func(t *testing.T, gw *egress.Gateway, policy egress.Policy) sandbox.Backend {
		b := c.backend(t, ns, Options{Egress: gw, Policy: policy})
		if policy.Empty() {
			return b
		}
		np, err := c.cs.NetworkingV1().NetworkPolicies(ns).Get(context.Background(), egressPolicyName(addr), metav1.GetOptions{})
		if err != nil {
			t.Fatalf("the egress NetworkPolicy: %v", err)
		}
		if got := np.Spec.Egress[0].To[0].IPBlock.CIDR; got != addr.String()+"/32" {
			t.Errorf("the egress NetworkPolicy leads to %s, want %s/32", got, addr)
		}
		return b
	})
}

// TestEgressRefusedWithoutListen: a gateway that wires boxes itself (no
// --egress-listen) cannot serve Pods, and the backend says so at start.
func TestEgressRefusedWithoutListen(t *testing.T) {
	gw, err := egress.NewGateway(egress.Options{})
	if err != nil {
		t.Skipf("the egress gateway cannot start here: %v", err)
	}
	defer gw.Close()
	p, _ := egress.ParsePolicy("example.org")
	_, err = New(context.Background(), Options{Image: "x", Egress: gw, Policy: p})
	if err == nil || !strings.Contains(err.Error(), "--egress-listen") {
		t.Fatalf("New with a namespace gateway: %v, want an error naming --egress-listen", err)
	}
}

// TestEgressSecret: a box Pod whose policy allows a secret's host gets
// the gateway's CA bundle from its ConfigMap at boxpolicy.TrustBundle and
// the placeholder in its environment; its HTTPS request to that host
// carries the value when it reaches the host, and the value appears
// nowhere the box can read: its environment, its files, the echo.
func TestEgressSecret(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	addr := c.podGateway(t, ns)
	in := egresstest.New(t)
	const value = "kiln-canary-0123456789abcdef"
	t.Setenv("KILN_TEST_K8S_SECRET", value)
	sec, err := egress.ParseSecret("API_TOKEN@api.test=env:KILN_TEST_K8S_SECRET")
	if err != nil {
		t.Fatal(err)
	}
	gw, err := egress.NewGateway(egress.Options{Listen: addr, HostsFile: in.HostsFile, Hosts: in.Hosts,
		TestOnlyAllowedAddrs: in.Allowed(), Resolver: in.Upstream.Resolver(), UpstreamRoots: in.Roots(), Secrets: []egress.Secret{sec}})
	if err != nil {
		t.Fatalf("a gateway on %v: %v", addr, err)
	}
	defer gw.Close()
	b := c.backend(t, ns, Options{Egress: gw, Policy: egress.MustParsePolicy("api.test")})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
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
print("bundle", os.environ.get("SSL_CERT_FILE"), "BEGIN CERTIFICATE" in open("`+boxpolicy.TrustBundle+`").read())
req = urllib.request.Request("https://api.test/echo", headers={"Authorization": "Bearer " + tok})
with urllib.request.urlopen(req, timeout=20) as r:
    print("status", r.status, "body", r.read().decode().strip())
`+sandboxtest.SecretSearchPy, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := res.Stdout.Text + res.Stderr.Text
	if res.Error != nil {
		t.Fatalf("the box's code failed: %s %s\n%s", res.Error.Name, res.Error.Value, out)
	}
	if strings.Contains(out, value) {
		t.Errorf("the value reached the box:\n%s", out)
	}
	if got := in.Served(); !slices.Equal(got, []string{"api.test auth=Bearer " + value + " key="}) {
		t.Errorf("api.test received %q, want the value; the box said:\n%s", got, out)
	}
	ph := sec.Placeholder()
	for _, want := range []string{"placeholder " + ph, "bundle " + boxpolicy.TrustBundle + " True", "status 200 body echo api.test auth=Bearer " + ph, "found []"} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
}
