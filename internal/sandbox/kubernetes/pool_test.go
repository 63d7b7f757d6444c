package kubernetes

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
)

// The warm pool on a real cluster.

// waitPool waits until replica ("": any) has n ready pool Pods of the
// spec's shape, and returns their names.
func waitPool(t testing.TB, b *Backend, replica string, n int) []string {
	t.Helper()
	shape, _ := b.pool.current()
	if shape == "" {
		t.Fatal("the pool has no shape: call Warm first")
	}
	ctx := context.Background()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		l, err := b.cs.CoreV1().Pods(b.opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: poolSelector(shape, replica)})
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, p := range takeable(l.Items, time.Now()) {
			names = append(names, p.Name)
		}
		if len(names) >= n {
			return names
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica %q: %d ready pool Pods after 2 minutes, want %d", replica, len(names), n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// podOf is the name of the Pod that holds box.
func podOf(b *Backend, box sandbox.Sandbox) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pods[box.ID()]
}

// TestPoolTakeRace: two replicas take from one pool at once, all of them
// as soon as the pool is full. Every box must get a Pod of its own: the
// take's update carries the resourceVersion it read, so of two takers of
// one Pod the second gets a Conflict and moves on. (With the
// precondition dropped, unconditionalTake, the takers all win the same
// oldest Pod.)
func TestPoolTakeRace(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	ctx := context.Background()
	const size = 4
	a := c.backend(t, ns, Options{Replica: "a", WarmPool: size})
	b := c.backend(t, ns, Options{Replica: "b"})
	if err := a.Warm(ctx, sandbox.Spec{}); err != nil {
		t.Fatal(err)
	}
	pool := waitPool(t, a, "a", size)
	type took struct {
		by  *Backend
		box sandbox.Sandbox
		err error
	}
	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		out   = make(chan took, size)
	)
	for i := range size {
		by := a
		if i%2 == 1 {
			by = b
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			box, err := by.Create(ctx, sandbox.Spec{ID: "race-" + randomSuffix()})
			out <- took{by, box, err}
		}()
	}
	close(start)
	wg.Wait()
	close(out)
	seen := map[string]bool{}
	fromPool := 0
	for r := range out {
		if r.err != nil {
			t.Fatal(r.err)
		}
		t.Cleanup(func() { r.box.Close() })
		name := podOf(r.by, r.box)
		if seen[name] {
			t.Errorf("two boxes got Pod %s", name)
		}
		seen[name] = true
		if slices.Contains(pool, name) {
			fromPool++
		}
	}
	if fromPool == 0 {
		t.Errorf("no box came from the pool %v: %v", pool, seen)
	}
	t.Logf("%d of %d boxes from the pool", fromPool, size)
	// Each taken Pod is its taker's now: label and owner.
	for name := range seen {
		p, err := c.cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if isPoolPod(p) {
			t.Errorf("taken Pod %s still carries %s", name, LabelPool)
		}
		owner := p.Labels[LabelReplica]
		if len(p.OwnerReferences) != 1 || p.OwnerReferences[0].Name != leaseName(owner) {
			t.Errorf("taken Pod %s: replica %q, owners %+v", name, owner, p.OwnerReferences)
		}
	}
}

// TestPoolRefills: a box taken from the pool is a pool Pod; the pool makes
// another in its place, and no more; closing the box deletes its Pod.
func TestPoolRefills(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	ctx := context.Background()
	b := c.backend(t, ns, Options{Replica: "r", WarmPool: 2})
	if err := b.Warm(ctx, sandbox.Spec{}); err != nil {
		t.Fatal(err)
	}
	before := waitPool(t, b, "r", 2)
	box, err := b.Create(ctx, sandbox.Spec{ID: "refill"})
	if err != nil {
		t.Fatal(err)
	}
	name := podOf(b, box)
	if !slices.Contains(before, name) {
		t.Fatalf("box's Pod %s is not one of the pool's %v", name, before)
	}
	if err := sandbox.Probe(ctx, box); err != nil {
		t.Fatal(err)
	}
	after := waitPool(t, b, "r", 2)
	if slices.Contains(after, name) {
		t.Fatalf("the taken Pod %s is still in the pool %v", name, after)
	}
	// No more than the pool's size, ready or not, after a few rounds.
	time.Sleep(2 * poolCheckEvery)
	l, err := c.cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: poolSelector("", "r")})
	if err != nil {
		t.Fatal(err)
	}
	var members []string
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil {
			members = append(members, p.Name)
		}
	}
	if len(members) != 2 {
		t.Errorf("pool members %v, want 2", members)
	}
	if err := box.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for len(b.Leftovers()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("after Close: %v", b.Leftovers())
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Close drains the pool.
	b.Close()
	deadline = time.Now().Add(time.Minute)
	for len(b.Leftovers()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("after the backend's Close: %v", b.Leftovers())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestPoolOfKilledReplicaCollected: a killed replica's pool Pods go with
// its Lease, as its boxes do.
func TestPoolOfKilledReplicaCollected(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	ctx := context.Background()
	a := c.backend(t, ns, Options{Replica: "a", WarmPool: 2, LeaseDuration: time.Second})
	if err := a.Warm(ctx, sandbox.Spec{}); err != nil {
		t.Fatal(err)
	}
	waitPool(t, a, "a", 2)
	a.abandon()
	time.Sleep(2500 * time.Millisecond) // twice the Lease's duration, unrenewed
	c.backend(t, ns, Options{Replica: "b"})
	deadline := time.Now().Add(2 * time.Minute)
	for {
		l, err := c.cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: LabelReplica + "=a"})
		if err != nil {
			t.Fatal(err)
		}
		if len(l.Items) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the killed replica's pool was not collected: %d Pods", len(l.Items))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestPoolReplacesPodsThatNeverRun: a pool Pod whose image does not pull is
// deleted and made again; Warm says that no Pod came ready.
func TestPoolReplacesPodsThatNeverRun(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	ctx := context.Background()
	bad := c.image[:strings.LastIndex(c.image, "/")+1] + "no-such-image:none"
	b := c.backend(t, ns, Options{Replica: "r", WarmPool: 1, Image: bad, StartTimeout: 15 * time.Second})
	if err := b.Warm(ctx, sandbox.Spec{}); err == nil {
		t.Fatal("Warm returned with no Pod able to run")
	}
	first := map[string]bool{}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		l, err := c.cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: poolSelector("", "r")})
		if err != nil {
			t.Fatal(err)
		}
		replaced := false
		for _, p := range l.Items {
			if len(first) == 0 {
				first[p.Name] = true
			} else if !first[p.Name] {
				replaced = true
			}
		}
		if replaced {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pool Pod that cannot run was not replaced: %v", podNames(l.Items))
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func podNames(pods []corev1.Pod) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.Name+" ("+podState(&p)+")")
	}
	return out
}

// BenchmarkCreate compares a box from the warm pool with one made for the
// call: Create until the agent's hello, then Close outside the timer.
func BenchmarkCreate(b *testing.B) {
	c := needCluster(b)
	for _, bc := range []struct {
		name string
		pool int
	}{{"pool-hit", 2}, {"pool-miss", 0}} {
		b.Run(bc.name, func(b *testing.B) {
			ns := c.namespace(b)
			be := c.backend(b, ns, Options{WarmPool: bc.pool})
			ctx := context.Background()
			if err := be.Warm(ctx, sandbox.Spec{}); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				if bc.pool > 0 {
					waitPool(b, be, "", 1)
				}
				b.StartTimer()
				box, err := be.Create(ctx, sandbox.Spec{ID: "bench-" + randomSuffix()})
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				hit := strings.HasPrefix(podOf(be, box), "kiln-"+poolPrefix)
				box.Close()
				if hit != (bc.pool > 0) {
					b.Fatalf("pool %d, but hit = %v", bc.pool, hit)
				}
				b.StartTimer()
			}
		})
	}
}

// TestPerCallTakesFromPool: a per-call server (no in-process pool) takes
// every call's box from the warm pool and deletes it after the call: every
// Pod the namespace sees is a pool Pod, and each call's is gone after it.
func TestPerCallTakesFromPool(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	ctx := context.Background()
	w, err := c.cs.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	args := []string{"--backend=kubernetes", "--mode=per-call", "--pool=0", "--k8s-warm-pool=2",
		"--k8s-image=" + c.image, "--k8s-namespace=" + ns, "--k8s-kubeconfig=" + os.Getenv("KUBECONFIG"), "--k8s-replica=pc"}
	if c.seccomp != "" {
		args = append(args, "--k8s-seccomp-profile="+c.seccomp)
	}
	srv := sandboxtest.StartStdio(t, args...)
	srv.Initialize(t)
	ready := func() int {
		l, err := c.cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: poolSelector("", "")})
		if err != nil {
			t.Fatal(err)
		}
		return len(takeable(l.Items, time.Now()))
	}
	const calls = 3
	for i := range calls {
		deadline := time.Now().Add(2 * time.Minute)
		for ready() == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("no pool Pod ready before call %d", i)
			}
			time.Sleep(100 * time.Millisecond)
		}
		srv.Send(t, fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"run_python","arguments":{"code":"print(6*7)"}}}`, i))
		m := srv.Await(t, fmt.Sprint(i), 5*time.Minute)
		if m.Error != nil || !strings.Contains(string(m.Result), "42") {
			t.Fatalf("call %d: %s %+v\nstderr:\n%s", i, m.Result, m.Error, srv.Stderr)
		}
	}
	added, deleted := map[string]bool{}, map[string]bool{}
	deadline := time.After(2 * time.Minute)
	for len(deleted) < calls {
		select {
		case ev := <-w.ResultChan():
			p, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			switch ev.Type {
			case "ADDED":
				added[p.Name] = true
			case "DELETED":
				deleted[p.Name] = true
			}
		case <-deadline:
			t.Fatalf("after %d calls, %d Pods deleted: %v", calls, len(deleted), deleted)
		}
	}
	for name := range added {
		if !strings.HasPrefix(name, "kiln-"+poolPrefix) {
			t.Errorf("Pod %s was made for a call, not taken from the pool", name)
		}
	}
	for name := range deleted {
		if !added[name] {
			t.Errorf("deleted Pod %s was never seen made", name)
		}
	}
}
