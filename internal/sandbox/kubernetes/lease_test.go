package kubernetes

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// The Lease bookkeeping's pure logic, on client-go's fake clientset; that
// the garbage collector deletes a dead replica's Pods is tested on a real
// cluster (TestKilledReplicaCollected).

func TestLeaseTakenOnce(t *testing.T) {
	ctx := context.Background()
	cs := fake.NewClientset()
	l, err := takeLease(ctx, cs, "ns", "r1", leaseDuration)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := takeLease(ctx, cs, "ns", "r1", leaseDuration); err == nil {
		t.Fatal("a second replica took a live replica's name")
	}
	if _, err := takeLease(ctx, cs, "ns", "r2", leaseDuration); err != nil {
		t.Fatalf("another name: %v", err)
	}
	// r1 stops renewing: after twice its duration it is dead, and its
	// name can be taken again.
	old := metav1.NewMicroTime(time.Now().Add(-3 * leaseDuration))
	l.Spec.RenewTime = &old
	if _, err := cs.CoordinationV1().Leases("ns").Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	dead, err := deadLeases(ctx, cs, "ns", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].Name != leaseName("r1") {
		t.Fatalf("dead leases %v, want r1's only", dead)
	}
	if _, err := takeLease(ctx, cs, "ns", "r1", leaseDuration); err != nil {
		t.Fatalf("taking a dead replica's name: %v", err)
	}
	if dead, _ := deadLeases(ctx, cs, "ns", time.Now()); len(dead) != 0 {
		t.Fatalf("dead leases after retaking: %v", dead)
	}
}

func TestLeaseExpiry(t *testing.T) {
	now := time.Now()
	secs := int32(30)
	for _, c := range []struct {
		renewed time.Duration
		want    bool
	}{{0, false}, {-59 * time.Second, false}, {-61 * time.Second, true}} {
		rt := metav1.NewMicroTime(now.Add(c.renewed))
		l, _ := takeLease(context.Background(), fake.NewClientset(), "ns", "r", leaseDuration)
		l.Spec.RenewTime, l.Spec.LeaseDurationSeconds = &rt, &secs
		if got := leaseExpired(l, now); got != c.want {
			t.Errorf("renewed %v ago: expired %v, want %v", -c.renewed, got, c.want)
		}
	}
}
