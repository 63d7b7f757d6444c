package kubernetes

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// The node Lease's rules, on client-go's fake clientset; a DaemonSet's Pods
// registering on a real cluster is TestNodeDaemonSet.
func TestNodeLeases(t *testing.T) {
	ctx := context.Background()
	cs := fake.NewClientset()
	opts := func(node, addr string) RegisterOptions {
		return RegisterOptions{Namespace: "ns", Node: node, Address: addr, Duration: 15 * time.Second}
	}
	list := func() []string {
		t.Helper()
		got, err := (&NodeLister{cs: cs, ns: "ns"}).Nodes(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	if _, err := (&NodeLister{cs: cs, ns: "ns"}).Nodes(ctx); err == nil {
		t.Fatal("no node registered, and the lister says nothing of it")
	}
	b, err := takeNodeLease(ctx, cs, opts("b", "10.0.0.2:7070"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := takeNodeLease(ctx, cs, opts("a", "10.0.0.1:7070")); err != nil {
		t.Fatal(err)
	}
	if got := list(); !slices.Equal(got, []string{"10.0.0.1:7070", "10.0.0.2:7070"}) {
		t.Errorf("nodes %v, want a's and b's in the order of their names", got)
	}
	// Another live node under b's name is refused; b's own next run (a
	// restarted container, the same address) takes its Lease over.
	if _, err := takeNodeLease(ctx, cs, opts("b", "10.0.0.9:7070")); err == nil {
		t.Error("a second node took a live node's name")
	}
	if _, err := takeNodeLease(ctx, cs, opts("b", "10.0.0.2:7070")); err != nil {
		t.Errorf("a node's next run at its address: %v", err)
	}
	// b stops renewing: past its duration no front places a box on it,
	// and another node may take the name.
	b, _ = cs.CoordinationV1().Leases("ns").Get(ctx, b.Name, metav1.GetOptions{})
	old := metav1.NewMicroTime(time.Now().Add(-16 * time.Second))
	b.Spec.RenewTime = &old
	if _, err := cs.CoordinationV1().Leases("ns").Update(ctx, b, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := list(); !slices.Equal(got, []string{"10.0.0.1:7070"}) {
		t.Errorf("nodes %v after b's Lease lapsed, want a's only", got)
	}
	if _, err := takeNodeLease(ctx, cs, opts("b", "10.0.0.9:7070")); err != nil {
		t.Errorf("taking a lapsed node's name: %v", err)
	}
	// A Lease anyone with write access made, with no address a front can
	// dial, is passed over.
	bad := b.DeepCopy()
	bad.Name, bad.ResourceVersion = nodeLeaseName("c"), ""
	now := metav1.NewMicroTime(time.Now())
	bad.Spec.RenewTime = &now
	bad.Annotations = map[string]string{AnnotationNodeAddress: "0.0.0.0:7070"}
	if _, err := cs.CoordinationV1().Leases("ns").Create(ctx, bad, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := list(); slices.Contains(got, "0.0.0.0:7070") {
		t.Errorf("nodes %v hold an address no front can dial", got)
	}
}

func TestNodeAddress(t *testing.T) {
	for addr, ok := range map[string]bool{
		"10.0.0.1:7070": true, "[fd00::1]:7070": true, "node.example:7070": true,
		":7070": false, "0.0.0.0:7070": false, "[::]:7070": false, "10.0.0.1": false, "": false,
	} {
		if err := checkNodeAddress(addr); (err == nil) != ok {
			t.Errorf("checkNodeAddress(%q) = %v, want ok %v", addr, err, ok)
		}
	}
}

// A Lease duration too short to renew is refused before anything is
// asked of the cluster.
func TestNodeLeaseDuration(t *testing.T) {
	for _, d := range []time.Duration{time.Nanosecond, time.Second, -time.Second} {
		if _, err := RegisterNode(context.Background(), RegisterOptions{Node: "n", Address: "10.0.0.1:7070", Duration: d}); err == nil || !strings.Contains(err.Error(), "at least 3s") {
			t.Errorf("duration %v: %v, want it refused", d, err)
		}
	}
}
