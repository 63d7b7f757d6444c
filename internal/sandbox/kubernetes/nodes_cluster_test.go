package kubernetes

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	coordv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"

	"kiln/internal/image"
	"kiln/internal/image/oci"
	"kiln/internal/sandbox"
	nodes "kiln/internal/sandbox/cluster"
	"kiln/internal/sandbox/sandboxtest"
)

// TestNodeDaemonSet runs contrib/kubernetes/node.yaml on the test
// cluster: two DaemonSets of kiln nodes, kept apart on its one node (a
// second cluster node cannot be had here), each Pod registering its Lease.
// A front finds them through the API (--cluster-discover) and runs the
// whole conformance suite, hostile battery included, through them. Then a
// node's Pod is killed under a box: the box says its node was lost, and
// the next box goes to the other node. A node's Pod deleted the ordinary
// way deletes its Lease as it goes. Between, contrib/kubernetes/front.yaml
// runs a front Pod on the nodes (testFrontDeployment).
func TestNodeDaemonSet(t *testing.T) {
	c := needCluster(t)
	img := c.nodeImage(t)
	ns := c.namespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	cs := c.cs

	certs := t.TempDir()
	if err := nodes.WriteCerts(certs, time.Hour); err != nil {
		t.Fatal(err)
	}
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "kiln-node-tls", Namespace: ns}, Data: map[string][]byte{}}
	for _, f := range []string{nodes.CAFile, nodes.NodeCertFile, nodes.NodeKeyFile} {
		b, err := os.ReadFile(filepath.Join(certs, f))
		if err != nil {
			t.Fatal(err)
		}
		sec.Data[f] = b
	}
	if _, err := cs.CoreV1().Secrets(ns).Create(ctx, sec, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	var ds *appsv1.DaemonSet
	for _, o := range manifest(t, "node.yaml") {
		var err error
		switch o := o.(type) {
		case *corev1.Namespace:
			// The test's namespace takes the manifest's Pod Security.
			nso, gerr := cs.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
			if gerr != nil {
				t.Fatal(gerr)
			}
			nso.Labels = o.Labels
			_, err = cs.CoreV1().Namespaces().Update(ctx, nso, metav1.UpdateOptions{})
		case *appsv1.DaemonSet:
			ds = o
		default:
			if !applyRBAC(t, cs, ns, o) {
				t.Fatalf("unexpected %T in node.yaml", o)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if ds == nil {
		t.Fatal("node.yaml has no DaemonSet")
	}
	ds.Namespace = ns
	ds.Spec.Template.Spec.Containers[0].Image = img
	// The test cluster has two CPUs: two nodes' requests must fit.
	ds.Spec.Template.Spec.Containers[0].Resources = corev1.ResourceRequirements{}
	// Its API server listens on the host's loopback only, and no
	// kube-proxy serves its Service: the node Pods use the host's network,
	// each DaemonSet its own port, and reach the API at the kubeconfig's
	// address.
	api, err := url.Parse(c.apiServer(t))
	if err != nil {
		t.Fatal(err)
	}
	ds.Spec.Template.Spec.HostNetwork = true
	ds.Spec.Template.Spec.DNSPolicy = corev1.DNSClusterFirstWithHostNet
	ds.Spec.Template.Spec.Containers[0].Ports = nil
	ds.Spec.Template.Spec.Containers[0].Env = append(ds.Spec.Template.Spec.Containers[0].Env,
		corev1.EnvVar{Name: "KUBERNETES_SERVICE_HOST", Value: api.Hostname()},
		corev1.EnvVar{Name: "KUBERNETES_SERVICE_PORT", Value: api.Port()})
	for i, name := range []string{"kiln-node-a", "kiln-node-b"} {
		d := ds.DeepCopy()
		d.Name = name
		sel := map[string]string{"app.kubernetes.io/name": name}
		d.Spec.Selector.MatchLabels, d.Spec.Template.Labels = sel, sel
		port := strconv.Itoa(17070 + i)
		args := d.Spec.Template.Spec.Containers[0].Args
		for j, a := range args {
			switch {
			case strings.HasPrefix(a, "--listen="):
				args[j] = "--listen=:" + port
			case strings.HasPrefix(a, "--k8s-advertise="):
				args[j] = "--k8s-advertise=$(POD_IP):" + port
			}
		}
		if _, err := cs.AppsV1().DaemonSets(ns).Create(ctx, d, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	lister, err := NewNodeLister(os.Getenv("KUBECONFIG"), ns)
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	if !waitUntil(ctx, 5*time.Minute, func() bool { listed, _ = lister.Nodes(ctx); return len(listed) == 2 }) {
		t.Fatalf("the two node Pods never registered (listed %v):\n%s", listed, c.podsOf(t, ns))
	}
	t.Logf("nodes registered: %v", listed)
	tlsCfg, err := nodes.FrontTLS(certs)
	if err != nil {
		t.Fatal(err)
	}
	front, err := nodes.New(nodes.Options{Discover: lister.Nodes, DiscoverEvery: time.Second, TLS: tlsCfg})
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()

	t.Run("conformance", func(t *testing.T) {
		sandboxtest.RunWith(t, front, sandboxtest.Options{HostProcesses: true})
	})
	t.Run("front Deployment", func(t *testing.T) {
		testFrontDeployment(t, c, ns, img, certs, c.apiServer(t))
	})

	// A node's Pod killed under a box.
	box, err := front.Create(ctx, sandbox.Spec{ID: "daemonset-loss"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	if err := sandbox.Probe(ctx, box); err != nil {
		t.Fatal(err)
	}
	lostAddr := nodes.NodeOf(box)
	pod := c.nodePodAt(t, ns, lostAddr)
	// SIGKILL from the host, as a crash or the host's OOM killer would:
	// deleting the Pod, even with no grace, sends SIGTERM first.
	killPodProcess(t, pod, "/sbin/kiln")
	select {
	case <-box.Done():
	case <-ctx.Done():
		t.Fatalf("the box of a killed node Pod (%s) never ended", pod.Name)
	}
	if why := box.(sandbox.HostLossReporter).HostLost(); !strings.Contains(why, "was lost") {
		t.Errorf("the box of a killed node Pod says %q, not that its node was lost", why)
	}
	next, err := front.Create(ctx, sandbox.Spec{ID: "daemonset-next"})
	if err != nil {
		t.Fatalf("no box after a node Pod was killed: %v", err)
	}
	defer next.Close()
	if err := sandbox.Probe(ctx, next); err != nil {
		t.Fatal(err)
	}
	if at := nodes.NodeOf(next); at == lostAddr {
		t.Errorf("the next box went to the killed node's address %s", at)
	}

	// The other node's Pod, deleted the ordinary way (SIGTERM), deletes
	// its Lease before it goes, so that no front places a box on it; a
	// killed one's is left to expire. The control: the Lease is there
	// before.
	other := c.nodePodAt(t, ns, nodes.NodeOf(next))
	if _, err := cs.CoordinationV1().Leases(ns).Get(ctx, nodeLeaseName(other.Name), metav1.GetOptions{}); err != nil {
		t.Fatalf("control: the Lease of node Pod %s: %v", other.Name, err)
	}
	if err := cs.CoreV1().Pods(ns).Delete(ctx, other.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(ctx, time.Minute, func() bool {
		_, err := cs.CoordinationV1().Leases(ns).Get(ctx, nodeLeaseName(other.Name), metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}) {
		t.Errorf("the Lease of node Pod %s, deleted with SIGTERM, is still there", other.Name)
	}
}

// killPodProcess sends SIGKILL, from the host, to the process of pod
// whose argv[0] is exe.
func killPodProcess(t *testing.T, pod *corev1.Pod, exe string) {
	t.Helper()
	uid := string(pod.UID)
	marks := []string{"pod" + uid, "pod" + strings.ReplaceAll(uid, "-", "_")}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		cg, err := os.ReadFile(p + "/cgroup")
		if err != nil || !strings.Contains(string(cg), marks[0]) && !strings.Contains(string(cg), marks[1]) {
			continue
		}
		argv, _ := os.ReadFile(p + "/cmdline")
		if first, _, _ := strings.Cut(string(argv), "\x00"); first != exe {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(p))
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatalf("killing %s of Pod %s (pid %d): %v", exe, pod.Name, pid, err)
		}
		return
	}
	t.Fatalf("no process %s of Pod %s on this host", exe, pod.Name)
}

// nodeImage is KILN_K8S_NODE_IMAGE, or a node image built from this tree
// (a full kiln beside the test's agent) and pushed to KILN_K8S_REGISTRY.
func (c *cluster) nodeImage(t *testing.T) string {
	t.Helper()
	if img := os.Getenv("KILN_K8S_NODE_IMAGE"); img != "" {
		return img
	}
	reg := os.Getenv("KILN_K8S_REGISTRY")
	if reg == "" {
		t.Fatal("set KILN_K8S_NODE_IMAGE, or KILN_K8S_REGISTRY to build and push the node image")
	}
	kiln := filepath.Join(t.TempDir(), "kiln")
	cmd := exec.Command("go", "build", "-tags", "kiln_kubernetes", "-o", kiln, "kiln/cmd/kiln")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building kiln for the node image: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	ref, err := oci.Build(ctx, image.Options{Agent: sandboxtest.BuildAgent(t)}, oci.Options{Ref: reg + "/kiln/node:test", Insecure: true, Node: kiln})
	if err != nil {
		t.Fatalf("building the node image: %v", err)
	}
	return ref
}

// nodePodAt is the node Pod of ns that registered addr: its Lease's
// holder.
func (c *cluster) nodePodAt(t *testing.T, ns, addr string) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	ls, err := c.cs.CoordinationV1().Leases(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(ls.Items, func(l coordv1.Lease) bool {
		return l.Annotations[AnnotationNodeAddress] == addr && l.Spec.HolderIdentity != nil
	})
	if i < 0 {
		t.Fatalf("no node Lease of %s holds %s", ns, addr)
	}
	p, err := c.cs.CoreV1().Pods(ns).Get(ctx, *ls.Items[i].Spec.HolderIdentity, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// apiServer is the API server's URL in the kubeconfig.
func (c *cluster) apiServer(t *testing.T) string {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv("KUBECONFIG"))
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Host
}

// podsOf says what the Pods of ns are doing, for a failure.
func (c *cluster) podsOf(t *testing.T, ns string) string {
	pods, err := c.cs.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, p := range pods.Items {
		fmt.Fprintf(&b, "%s %s %s", p.Name, p.Status.Phase, p.Status.PodIP)
		for _, s := range p.Status.ContainerStatuses {
			if w := s.State.Waiting; w != nil {
				fmt.Fprintf(&b, " waiting: %s %s", w.Reason, w.Message)
			}
			if x := s.LastTerminationState.Terminated; x != nil {
				fmt.Fprintf(&b, " last exit %d: %s", x.ExitCode, x.Message)
			}
		}
		b.WriteString("\n")
		tail := int64(5)
		logs, _ := c.cs.CoreV1().Pods(ns).GetLogs(p.Name, &corev1.PodLogOptions{Previous: true, TailLines: &tail}).DoRaw(context.Background())
		b.Write(logs)
	}
	return b.String()
}

// waitUntil polls cond every 200 ms for at most d.
func waitUntil(ctx context.Context, d time.Duration, cond func() bool) bool {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for !cond() {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(200 * time.Millisecond):
		}
	}
	return true
}
