package kubernetes

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	nodes "kiln/internal/sandbox/cluster"
)

// frontPort is where the test's front Pod serves, on the host's network.
const frontPort = 18080

// testFrontDeployment runs contrib/kubernetes/front.yaml in ns, beside the
// node DaemonSets there: a front Pod that finds the nodes by their Leases
// and counts sessions in ns. A real MCP client starts a session through
// it; the front's process is killed with SIGKILL, the kubelet restarts
// it, and the session goes on in its box with its variable; then the
// front's Pod is deleted (SIGTERM), and it goes on through the next. As shipped,
// the front's Pod is admitted by Pod Security baseline (a dry run in a
// namespace of namespace.yaml's labels; the control: the test's own
// patch, the host's network, is refused there).
func testFrontDeployment(t *testing.T, c *cluster, ns, img, certs, api string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cs := c.cs

	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "kiln-front-tls", Namespace: ns}, Data: map[string][]byte{}}
	for _, f := range []string{nodes.CAFile, nodes.FrontCertFile, nodes.FrontKeyFile} {
		b, err := os.ReadFile(filepath.Join(certs, f))
		if err != nil {
			t.Fatal(err)
		}
		sec.Data[f] = b
	}
	token := "front-token-" + randomSuffix() + randomSuffix()
	tok := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "kiln-token", Namespace: ns}, StringData: map[string]string{"token": token}}
	for _, s := range []*corev1.Secret{sec, tok} {
		if _, err := cs.CoreV1().Secrets(ns).Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, o := range manifest(t, "rbac.yaml") {
		if !applyRBAC(t, cs, ns, o) {
			t.Fatalf("unexpected %T in rbac.yaml", o)
		}
	}
	var dep *appsv1.Deployment
	for _, o := range manifest(t, "front.yaml") {
		switch o := o.(type) {
		case *appsv1.Deployment:
			dep = o
		case *corev1.Service:
			o.Namespace = ns
			if _, err := cs.CoreV1().Services(ns).Create(ctx, o, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatalf("unexpected %T in front.yaml", o)
		}
	}
	if dep == nil {
		t.Fatal("front.yaml has no Deployment")
	}

	// As shipped, baseline admits the front's Pod; the host's network,
	// which this cluster makes the test use, it refuses.
	baseline := c.namespace(t)
	nso, err := cs.CoreV1().Namespaces().Get(ctx, baseline, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range manifest(t, "namespace.yaml") {
		nso.Labels = o.(*corev1.Namespace).Labels
	}
	if _, err := cs.CoreV1().Namespaces().Update(ctx, nso, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The Pod names its ServiceAccount, which admission looks up.
	if _, err := cs.CoreV1().ServiceAccounts(baseline).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: dep.Spec.Template.Spec.ServiceAccountName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dry := func(spec corev1.PodSpec) error {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "front-dry-run", Namespace: baseline}, Spec: spec}
		_, err := cs.CoreV1().Pods(baseline).Create(ctx, p, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	if err := dry(*dep.Spec.Template.Spec.DeepCopy()); err != nil {
		t.Fatalf("Pod Security baseline refuses front.yaml's Pod: %v", err)
	}
	host := dep.Spec.Template.Spec.DeepCopy()
	host.HostNetwork = true
	if err := dry(*host); err == nil {
		t.Fatal("control: baseline admitted a front Pod on the host's network: the dry run checks nothing")
	}

	// The test's patches: one replica on the host's network (the API
	// server listens on loopback, and no kube-proxy serves Services), the
	// nodes and the ledger in ns.
	apiURL := strings.TrimPrefix(strings.TrimPrefix(api, "https://"), "http://")
	apiHost, apiPort, _ := strings.Cut(apiURL, ":")
	dep.Namespace = ns
	one := int32(1)
	dep.Spec.Replicas = &one
	spec := &dep.Spec.Template.Spec
	spec.HostNetwork = true
	spec.DNSPolicy = corev1.DNSClusterFirstWithHostNet
	spec.InitContainers[0].Image = img
	ctr := &spec.Containers[0]
	ctr.Image = img
	ctr.Resources = corev1.ResourceRequirements{}
	ctr.Ports = nil
	ctr.ReadinessProbe.HTTPGet.Port = intstr.FromInt32(frontPort)
	ctr.Env = append(ctr.Env,
		corev1.EnvVar{Name: "KUBERNETES_SERVICE_HOST", Value: apiHost},
		corev1.EnvVar{Name: "KUBERNETES_SERVICE_PORT", Value: apiPort})
	for i, a := range ctr.Args {
		switch {
		case strings.HasPrefix(a, "--addr="):
			ctr.Args[i] = fmt.Sprintf("--addr=:%d", frontPort)
		case strings.HasPrefix(a, "--cluster-discover="):
			ctr.Args[i] = "--cluster-discover=" + ns
		}
	}
	if _, err := cs.AppsV1().Deployments(ns).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	frontPod := func() *corev1.Pod {
		pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=kiln-front"})
		if err != nil || len(pods.Items) != 1 {
			return nil
		}
		return &pods.Items[0]
	}
	ready := func(restarts int32) bool {
		p := frontPod()
		if p == nil || len(p.Status.ContainerStatuses) == 0 {
			return false
		}
		s := p.Status.ContainerStatuses[0]
		return s.Ready && s.RestartCount >= restarts
	}
	if !waitUntil(ctx, 5*time.Minute, func() bool { return ready(0) }) {
		t.Fatalf("the front Pod never became ready:\n%s", c.podsOf(t, ns))
	}

	call := func(code string) string {
		t.Helper()
		client := mcp.NewClient(&mcp.Implementation{Name: "kiln-front-test", Version: "1"}, nil)
		sess, err := client.Connect(ctx, &mcp.StreamableClientTransport{
			Endpoint:   fmt.Sprintf("http://127.0.0.1:%d/mcp", frontPort),
			HTTPClient: &http.Client{Transport: bearerToken(token)},
		}, nil)
		if err != nil {
			t.Fatalf("connecting to the front: %v\n%s", err, c.podsOf(t, ns))
		}
		defer sess.Close()
		res, err := sess.CallTool(ctx, &mcp.CallToolParams{Name: "run_python", Arguments: map[string]any{"session": "dep", "code": code}})
		if err != nil {
			t.Fatalf("run_python %q: %v", code, err)
		}
		var b strings.Builder
		for _, ct := range res.Content {
			if tc, ok := ct.(*mcp.TextContent); ok {
				b.WriteString(tc.Text)
			}
		}
		if res.IsError {
			t.Fatalf("run_python %q: %s", code, b.String())
		}
		return b.String()
	}
	call("x = 41")
	killPodProcess(t, frontPod(), "/sbin/kiln")
	if !waitUntil(ctx, 5*time.Minute, func() bool { return ready(1) }) {
		t.Fatalf("the killed front was not restarted:\n%s", c.podsOf(t, ns))
	}
	got := call("print(x + 1)")
	if !strings.Contains(got, "42") || strings.Contains(got, "Error") {
		t.Fatalf("after the front was killed, the session says:\n%s", got)
	}
	p := frontPod()
	t.Logf("front Pod %s: its kiln killed and restarted (restarts: %d); the session then said %q",
		p.Name, p.Status.ContainerStatuses[0].RestartCount, strings.TrimSpace(got))

	// The front's Pod deleted the ordinary way (SIGTERM, as in a rolling
	// update): the Deployment's next Pod goes on with the session.
	if err := cs.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(ctx, 5*time.Minute, func() bool {
		q := frontPod()
		return q != nil && q.Name != p.Name && len(q.Status.ContainerStatuses) > 0 && q.Status.ContainerStatuses[0].Ready
	}) {
		t.Fatalf("no new front Pod became ready after %s was deleted:\n%s", p.Name, c.podsOf(t, ns))
	}
	got = call("print(x + 2)")
	if !strings.Contains(got, "43") || strings.Contains(got, "Error") {
		t.Fatalf("after the front's Pod was deleted, the session says:\n%s", got)
	}
	t.Logf("front Pod %s deleted, %s in its place; the session then said %q", p.Name, frontPod().Name, strings.TrimSpace(got))
}

// bearerToken sends its token with every request.
type bearerToken string

func (b bearerToken) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+string(b))
	return http.DefaultTransport.RoundTrip(r)
}
