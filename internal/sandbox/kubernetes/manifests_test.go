package kubernetes

import (
	"bytes"
	"context"
	"maps"
	"os"
	"path/filepath"
	goruntime "runtime"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	netv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
)

// manifest reads contrib/kubernetes/name as typed objects.
func manifest(t *testing.T, name string) []runtime.Object {
	t.Helper()
	_, file, _, _ := goruntime.Caller(0)
	b, err := os.ReadFile(filepath.Join(filepath.Dir(file), "..", "..", "..", "contrib", "kubernetes", name))
	if err != nil {
		t.Fatal(err)
	}
	var out []runtime.Object
	r := utilyaml.NewYAMLReader(bufioReader(b))
	for {
		doc, err := r.Read()
		if err != nil {
			break
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out = append(out, obj)
	}
	return out
}

// TestManifestsParse reads every manifest of contrib/kubernetes as the API's
// own types: a field the API does not know fails here, not at apply time.
func TestManifestsParse(t *testing.T) {
	for _, n := range []string{"namespace.yaml", "rbac.yaml", "runtimeclass.yaml", "networkpolicy.yaml", "deployment.yaml", "node.yaml", "front.yaml"} {
		if objs := manifest(t, n); len(objs) == 0 {
			t.Errorf("%s: no object", n)
		}
	}
	// The NetworkPolicy kiln applies is the one in the manifests.
	for _, o := range manifest(t, "networkpolicy.yaml") {
		np := o.(*netv1.NetworkPolicy)
		want := DenyAll(np.Namespace)
		if np.Name != want.Name || !equalJSON(t, np.Spec, want.Spec) {
			t.Errorf("networkpolicy.yaml differs from DenyAll: %+v", np.Spec)
		}
	}
}

// TestRBACSuffices applies rbac.yaml in a fresh namespace and runs boxes
// with the ServiceAccount's own token: the Role grants all the backend
// needs (Pods, attach, Leases, NetworkPolicy, and a session's Pod bound and
// adopted by another replica).
// applyRBAC creates o, a ServiceAccount, Role or RoleBinding of a
// manifest, in ns (the binding's ServiceAccounts too), and says whether o
// was one of those.
func applyRBAC(t *testing.T, cs kubernetes.Interface, ns string, o runtime.Object) bool {
	t.Helper()
	ctx := context.Background()
	var err error
	switch o := o.(type) {
	case *corev1.ServiceAccount:
		o.Namespace = ns
		_, err = cs.CoreV1().ServiceAccounts(ns).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.Role:
		o.Namespace = ns
		_, err = cs.RbacV1().Roles(ns).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.RoleBinding:
		o.Namespace = ns
		for i := range o.Subjects {
			if o.Subjects[i].Kind == rbacv1.ServiceAccountKind {
				o.Subjects[i].Namespace = ns
			}
		}
		_, err = cs.RbacV1().RoleBindings(ns).Create(ctx, o, metav1.CreateOptions{})
	default:
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

func TestRBACSuffices(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	ctx := context.Background()
	cs := c.cs
	for _, o := range manifest(t, "rbac.yaml") {
		if !applyRBAC(t, cs, ns, o) {
			t.Fatalf("unexpected %T in rbac.yaml", o)
		}
	}
	// The namespace's Pod Security level is namespace.yaml's: the
	// cluster's admission holds the box Pod to it.
	var labels map[string]string
	for _, o := range manifest(t, "namespace.yaml") {
		labels = o.(*corev1.Namespace).Labels
	}
	if labels["pod-security.kubernetes.io/enforce"] != "baseline" {
		t.Errorf("namespace.yaml enforces Pod Security %q, want baseline (the agent is root with a few capabilities)", labels["pod-security.kubernetes.io/enforce"])
	}
	setLevel := func(l map[string]string) {
		t.Helper()
		nso, err := cs.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if nso.Labels == nil {
			nso.Labels = map[string]string{}
		}
		maps.Copy(nso.Labels, l)
		if _, err := cs.CoreV1().Namespaces().Update(ctx, nso, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// "restricted" refuses the box Pod (its agent is root with a few
	// capabilities): the cluster's admission is on, and baseline is needed.
	setLevel(map[string]string{"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"})
	p := testPod(t, func(c *podConfig) { c.Namespace, c.SeccompProfile = ns, "" })
	if _, err := cs.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); !apierrors.IsForbidden(err) {
		t.Errorf("Pod Security restricted admits the box Pod: %v", err)
	}
	setLevel(labels)
	tok, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "kiln", &authv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	admin, err := clientcmd.BuildConfigFromFlags("", os.Getenv("KUBECONFIG"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := rest.AnonymousClientConfig(admin)
	cfg.BearerToken = tok.Status.Token
	scs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b := c.backend(t, ns, Options{Client: scs, Config: cfg})
	box, err := b.Create(ctx, sandbox.Spec{ID: "rbac"})
	if err != nil {
		t.Fatal(err)
	}
	if err := sandbox.Probe(ctx, box); err != nil {
		t.Error(err)
	}
	// A session's box is labelled with it, and another replica moves it
	// to itself: both update the Pod.
	if err := b.Bind(ctx, box, "rbac\x00session"); err != nil {
		t.Fatal(err)
	}
	other := c.backend(t, ns, Options{Client: scs, Config: cfg})
	adopted, err := other.Adopt(ctx, "rbac\x00session")
	if err != nil {
		t.Fatal(err)
	}
	if err := sandbox.Probe(ctx, adopted); err != nil {
		t.Error(err)
	}
	for _, b := range []sandbox.Sandbox{adopted, box} {
		if err := b.Close(); err != nil {
			t.Error(err)
		}
	}
	// With --allow-net a replica applies the boxes' egress policy, and the
	// next one brings it up to date.
	// A secret's host makes it store the gateway's CA bundle, too.
	addr := c.podGateway(t, ns)
	t.Setenv("KILN_TEST_RBAC_SECRET", "v")
	sec, err := egress.ParseSecret("T@example.org=env:KILN_TEST_RBAC_SECRET")
	if err != nil {
		t.Fatal(err)
	}
	gw, err := egress.NewGateway(egress.Options{Listen: addr, Secrets: []egress.Secret{sec}})
	if err != nil {
		t.Fatalf("a gateway on %v: %v", addr, err)
	}
	defer gw.Close()
	pol, _ := egress.ParsePolicy("example.org")
	for range 2 {
		b := c.backend(t, ns, Options{Client: scs, Config: cfg, Egress: gw, Policy: pol})
		b.Close()
	}
	// With --cluster-quotas a front holds its Lease and writes, and then
	// deletes, a principal's count.
	g, err := newSessionLedger(ctx, scs, LedgerOptions{Namespace: ns, Front: "rbac", Duration: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	g.Bind(func(string) []string { return []string{"s"} })
	if ok, _, err := g.Claim(ctx, "alice", 4); err != nil || !ok {
		t.Errorf("the ServiceAccount's front could not count a session: %v, %v", ok, err)
	}
	g.Bind(func(string) []string { return nil })
	if ok, _, err := g.Claim(ctx, "alice", 4); err != nil || !ok {
		t.Errorf("the ServiceAccount's front could not count a session out: %v, %v", ok, err)
	}
	if err := g.Close(); err != nil {
		t.Error(err)
	}
}
