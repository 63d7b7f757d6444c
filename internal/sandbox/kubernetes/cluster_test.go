package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"kiln/internal/image"
	"kiln/internal/image/oci"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
)

// Tests on a real cluster (make k8s-cluster; `contrib/k8s/cluster/cluster.sh
// env` gives the variables). They run with KILN_TEST_K8S=1 and need:
//   KUBECONFIG             the cluster's admin kubeconfig
//   KILN_K8S_IMAGE         a pushed box image, or KILN_K8S_REGISTRY to build
//                          and push one there (kiln image build --oci)
//   KILN_K8S_SECCOMP_DIR   the kubelet's seccomp directory (optional: else
//                          the runtime's default profile is used)

type cluster struct {
	cs      kubernetes.Interface
	image   string
	seccomp string
}

var (
	clusterOnce sync.Once
	theCluster  *cluster
	clusterErr  error
)

func needCluster(t testing.TB) *cluster {
	t.Helper()
	if os.Getenv("KILN_TEST_K8S") != "1" {
		t.Skip("needs a Kubernetes cluster: set KILN_TEST_K8S=1 and the variables of `contrib/k8s/cluster/cluster.sh env` (make k8s-cluster)")
	}
	if os.Getenv("KUBECONFIG") == "" {
		t.Fatal("KILN_TEST_K8S=1 but KUBECONFIG is not set")
	}
	agent := sandboxtest.BuildAgent(t)
	clusterOnce.Do(func() { theCluster, clusterErr = setUpCluster(agent) })
	if clusterErr != nil {
		t.Fatal(clusterErr)
	}
	return theCluster
}

func setUpCluster(agent string) (*cluster, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv("KUBECONFIG"))
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	c := &cluster{cs: cs, image: os.Getenv("KILN_K8S_IMAGE")}
	if c.image == "" {
		reg := os.Getenv("KILN_K8S_REGISTRY")
		if reg == "" {
			return nil, fmt.Errorf("set KILN_K8S_IMAGE, or KILN_K8S_REGISTRY to build and push the box image")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
		defer cancel()
		ref, err := oci.Build(ctx, image.Options{Agent: agent}, oci.Options{Ref: reg + "/kiln/box:test", Insecure: true})
		if err != nil {
			return nil, fmt.Errorf("building the box image: %w", err)
		}
		c.image = ref
	}
	if dir := os.Getenv("KILN_K8S_SECCOMP_DIR"); dir != "" {
		p := filepath.Join(dir, "kiln", "box.json")
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return nil, err
		}
		if err := os.WriteFile(p, SeccompProfile(), 0o644); err != nil {
			return nil, err
		}
		c.seccomp = "kiln/box.json"
	}
	return c, nil
}

// namespace makes a namespace for one test and deletes it afterwards.
func (c *cluster) namespace(t testing.TB) string {
	t.Helper()
	ns := "kiln-test-" + randomSuffix()
	_, err := c.cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.cs.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	})
	return ns
}

func (c *cluster) backend(t testing.TB, ns string, o Options) *Backend {
	t.Helper()
	o.Kubeconfig = os.Getenv("KUBECONFIG")
	o.Namespace = ns
	if o.Image == "" {
		o.Image = c.image
	}
	if o.SeccompProfile == "" {
		o.SeccompProfile = c.seccomp
	}
	if testing.Verbose() {
		o.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	b, err := New(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// runtimeClass skips unless the cluster has the RuntimeClass.
func (c *cluster) runtimeClass(t *testing.T, name string) {
	t.Helper()
	_, err := c.cs.NodeV1().RuntimeClasses().Get(context.Background(), name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		t.Skipf("the cluster has no RuntimeClass %s", name)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// A box's workspace and /tmp are memory-backed emptyDirs: tmpfs without an
// inode cap, whose files count against the memory limit, so an inode fill
// may end the box as a memory bomb does.
var conformance = sandboxtest.Options{
	MemoryBombKillsBox: true,
	NoInodeCap:         "the kubelet mounts a memory-backed emptyDir as a tmpfs with a size and no inode cap; its files count against the Pod's memory limit",
	// Seen on the test cluster's runc Pods: /work, /tmp and /dev/shm are
	// tmpfs of the plan's sizes, mounted rw,relatime, mode 1777, owned by
	// root.
	PlatformTmpfs: "the kubelet mounts memory-backed emptyDirs itself, without nosuid or nodev and with mode 1777 owned by root, and kiln cannot remount them; the agent starts the box's code as the box's own uid with no capabilities, under no_new_privs (allowPrivilegeEscalation: false), so a setuid bit is inert and the code cannot make a device node; the Pod holds no other user's code",
}

// options is conformance on c: without kiln's profile on the nodes
// (KILN_K8S_SECCOMP_DIR), boxes run under the runtime's default one.
func (c *cluster) options() sandboxtest.Options {
	o := conformance
	if c.seccomp == "" {
		o.OtherSyscallPolicy = "KILN_K8S_SECCOMP_DIR is not set, so boxes run under the container runtime's default seccomp profile"
	}
	return o
}

func TestConformanceRunc(t *testing.T) {
	c := needCluster(t)
	c.runtimeClass(t, "runc")
	b := c.backend(t, c.namespace(t), Options{RuntimeClass: "runc"})
	sandboxtest.RunWith(t, b, c.options())
}

// TestConformanceGVisor: runsc, under the kubelet as under kiln's gVisor
// backend, ignores the nodev mount option and the spec's maskedPaths.
func TestConformanceGVisor(t *testing.T) {
	c := needCluster(t)
	c.runtimeClass(t, "gvisor")
	b := c.backend(t, c.namespace(t), Options{RuntimeClass: "gvisor"})
	o := c.options()
	o.NoNodev = "runsc ignores the nodev mount option; the only devices in a gVisor box are the sentry's own emulated ones, never the host's"
	o.NoProcMasks = "runsc ignores the OCI spec's maskedPaths; the box's /proc is the sentry's own"
	sandboxtest.RunWith(t, b, o)
}

// TestKilledReplicaCollected kills a replica (it stops renewing its Lease
// and deletes nothing); the next replica to start finds its Lease expired
// and deletes it, and the cluster's garbage collector deletes its boxes.
func TestKilledReplicaCollected(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	ctx := context.Background()
	a := c.backend(t, ns, Options{Replica: "a", LeaseDuration: time.Second})
	box, err := a.Create(ctx, sandbox.Spec{ID: "orphan"})
	if err != nil {
		t.Fatal(err)
	}
	if err := sandbox.Probe(ctx, box); err != nil {
		t.Fatal(err)
	}
	a.abandon()
	pods := func() []string {
		l, err := c.cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: LabelReplica + "=a"})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, p := range l.Items {
			out = append(out, p.Name)
		}
		return out
	}
	if len(pods()) != 1 {
		t.Fatalf("the killed replica's box: pods %v", pods())
	}
	time.Sleep(2500 * time.Millisecond) // twice the Lease's duration, unrenewed
	c.backend(t, ns, Options{Replica: "b"})
	deadline := time.Now().Add(2 * time.Minute)
	for len(pods()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the killed replica's boxes were not collected: %v", pods())
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := c.cs.CoordinationV1().Leases(ns).Get(ctx, leaseName("a"), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the killed replica's Lease: %v", err)
	}
	box.Close() // its stream is gone with the Pod
}

// TestClosedReplicaLeavesNothing: a replica that ends deletes its Lease and
// its boxes.
func TestClosedReplicaLeavesNothing(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	b := c.backend(t, ns, Options{Replica: "solo"})
	if _, err := b.Create(context.Background(), sandbox.Spec{ID: "left-open"}); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		left := b.Leftovers()
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after Close: %s", strings.Join(left, ", "))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestSessionContinuesOnAnotherReplica: a session's box made by replica a
// is adopted by replica b, kernel state kept (the Pod is the same); a's
// connection to it ends, and a's Close of it leaves the Pod to b. Then a
// is killed mid-session and b takes the box back as well.
func TestSessionContinuesOnAnotherReplica(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	ctx := context.Background()
	a := c.backend(t, ns, Options{Replica: "a"})
	b := c.backend(t, ns, Options{Replica: "b"})
	const key = "principal\x00analysis"
	boxA, err := a.Create(ctx, sandbox.Spec{ID: "s1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Bind(ctx, boxA, key); err != nil {
		t.Fatal(err)
	}
	run := func(box sandbox.Sandbox, code string) string {
		t.Helper()
		r, err := box.RunPython(ctx, code, sandbox.ExecOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Error != nil {
			t.Fatalf("%s: %+v", code, r.Error)
		}
		return r.Result["text/plain"]
	}
	run(boxA, "x = 41")
	if _, err := b.Adopt(ctx, "principal\x00other"); !errors.Is(err, sandbox.ErrNoBox) {
		t.Fatalf("adopting a key no box holds: %v", err)
	}
	boxB, err := b.Adopt(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if got := run(boxB, "x + 1"); got != "42" {
		t.Fatalf("x + 1 on the adopting replica = %q, want 42", got)
	}
	select {
	case <-boxA.Done():
	case <-time.After(30 * time.Second):
		t.Error("the first replica's connection outlived the takeover")
	}
	boxA.Close()
	if got := run(boxB, "x + 2"); got != "43" {
		t.Fatalf("after the first replica closed its handle: x + 2 = %q", got)
	}
	// b is killed; a adopts the box back.
	b.abandon()
	boxA2, err := a.Adopt(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if got := run(boxA2, "x"); got != "41" {
		t.Fatalf("after the second replica was killed: x = %q", got)
	}
	boxB.Close()
	if err := boxA2.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for len(a.Leftovers()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the session's Pod outlived its last Close: %v", a.Leftovers())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// podGateway is the node's address on the Pods' network, where the tests'
// gateways listen. The bridge plugin gives the bridge that address with
// its first Pod, so one box is made first if no Pod has run yet.
func (c *cluster) podGateway(t *testing.T, ns string) netip.Addr {
	t.Helper()
	addr, err := netip.ParseAddr(os.Getenv("KILN_K8S_POD_GATEWAY"))
	if err != nil {
		t.Skip("KILN_K8S_POD_GATEWAY (the node's address on the Pods' network, from `contrib/k8s/cluster/cluster.sh env`) is not set")
	}
	local := func() bool {
		as, _ := net.InterfaceAddrs()
		for _, a := range as {
			if n, ok := a.(*net.IPNet); ok && n.IP.Equal(addr.AsSlice()) {
				return true
			}
		}
		return false
	}
	if !local() {
		b := c.backend(t, ns, Options{})
		box, err := b.Create(context.Background(), sandbox.Spec{ID: "bridge-up"})
		if err != nil {
			t.Fatal(err)
		}
		box.Close()
		b.Close()
	}
	if !local() {
		t.Fatalf("%v is not an address of this host even after a Pod ran: KILN_K8S_POD_GATEWAY is wrong", addr)
	}
	return addr
}
