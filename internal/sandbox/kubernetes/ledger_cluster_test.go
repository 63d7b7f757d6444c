package kubernetes

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// testFront is a front's sessions for a ledger test: names per principal,
// and the ones being admitted.
type testFront struct {
	*SessionLedger
	mu   sync.Mutex
	live map[string][]string
}

func newTestFront(t *testing.T, c *cluster, ns, name string) *testFront {
	t.Helper()
	g, err := NewSessionLedger(context.Background(), LedgerOptions{Namespace: ns, Front: name, Duration: 3 * time.Second, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)).With("front", name)})
	if err != nil {
		t.Fatal(err)
	}
	f := &testFront{SessionLedger: g, live: map[string][]string{}}
	g.Bind(func(p string) []string {
		f.mu.Lock()
		defer f.mu.Unlock()
		return slices.Sorted(slices.Values(f.live[p]))
	})
	return f
}

// admit is what a session manager does: the name counts as live while
// it is claimed, and is dropped when the claim fails.
func (f *testFront) admit(t *testing.T, principal, name string, limit int) bool {
	t.Helper()
	f.mu.Lock()
	f.live[principal] = append(f.live[principal], name)
	f.mu.Unlock()
	ok, _, err := f.Claim(context.Background(), principal, limit)
	if err != nil {
		t.Error(err)
	}
	if !ok || err != nil {
		f.drop(principal, name)
	}
	return ok && err == nil
}

func (f *testFront) drop(principal, name string) {
	f.mu.Lock()
	f.live[principal] = slices.DeleteFunc(f.live[principal], func(n string) bool { return n == name })
	f.mu.Unlock()
}

// recorded is the count of the principal's sessions in its Lease, by
// front.
func recorded(t *testing.T, c *cluster, ns, principal string) map[string][]string {
	t.Helper()
	l, err := c.cs.CoordinationV1().Leases(ns).Get(context.Background(), sessionsLeaseName(principal), metav1.GetOptions{})
	if err != nil {
		return nil
	}
	var out map[string][]string
	if err := json.Unmarshal([]byte(l.Annotations[AnnotationSessions]), &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestSessionLedger holds one principal's quota across fronts on the test
// cluster's API server: claims at once from two fronts admit exactly the
// quota, a front's reset makes room for another, and a front that closes,
// or dies, stops counting. Each step's control is a claim that is
// admitted, or refused, before it.
func TestSessionLedger(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	a := newTestFront(t, c, ns, "a")
	defer a.Close()
	b := newTestFront(t, c, ns, "b")
	defer b.Close()

	if _, err := newSessionLedger(context.Background(), c.cs, LedgerOptions{Namespace: ns, Front: "b", Duration: 3 * time.Second}); err == nil {
		t.Error("a second front took a live front's name")
	}

	// Eight fronts claim at once, past a session a holds already: with
	// a quota of 9 all are admitted (the control), with a quota of 4
	// exactly three. Each front writes one claim at a time, so the race
	// is between fronts, on the Lease's resourceVersion.
	var racers []*testFront
	for i := range 8 {
		f := newTestFront(t, c, ns, fmt.Sprint("racer", i))
		defer f.Close()
		racers = append(racers, f)
	}
	race := func(principal string, limit int) int {
		if !a.admit(t, principal, "first", limit) {
			t.Fatalf("%s: the first claim was refused", principal)
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		admitted := 0
		start := make(chan struct{})
		for i, f := range racers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				if f.admit(t, principal, fmt.Sprint("s", i), limit) {
					mu.Lock()
					admitted++
					mu.Unlock()
				}
			}()
		}
		close(start)
		wg.Wait()
		return admitted
	}
	if n := race("roomy", 9); n != 8 {
		t.Fatalf("8 claims at once past 1 at a quota of 9: %d admitted", n)
	}
	if n := race("tight", 4); n != 3 {
		t.Errorf("8 claims at once from eight fronts past 1 at a quota of 4: %d admitted", n)
	}
	total := 0
	for _, names := range recorded(t, c, ns, "tight") {
		total += len(names)
	}
	if total != 4 {
		t.Errorf("the Lease records %d sessions (%v), want 4", total, recorded(t, c, ns, "tight"))
	}
	t.Logf("admitted at a quota of 4: %v", recorded(t, c, ns, "tight"))

	// A session that ends on one front makes room on the other, once
	// synced.
	p := "quota2"
	if !a.admit(t, p, "one", 2) || !a.admit(t, p, "two", 2) {
		t.Fatal("two claims within a quota of 2 were refused")
	}
	if b.admit(t, p, "three", 2) {
		t.Fatal("a third session on another front, past a quota of 2, was admitted")
	}
	a.drop(p, "two")
	a.Sync(p)
	waitFor(t, func() bool { return len(recorded(t, c, ns, p)["a"]) == 1 })
	if !b.admit(t, p, "three", 2) {
		t.Error("after a's session ended, b's claim was refused")
	}

	// A front that closes stops counting at once.
	b.drop(p, "three")
	b.Sync(p)
	waitFor(t, func() bool { return len(recorded(t, c, ns, p)["b"]) == 0 })
	if !a.admit(t, p, "two", 2) {
		t.Fatal("a's own second session was refused")
	}
	d := newTestFront(t, c, ns, "d")
	if d.admit(t, p, "x", 2) {
		t.Fatal("a new front admitted past the quota")
	}
	a.Close()
	if !d.admit(t, p, "x", 2) {
		t.Error("after front a closed, its sessions still count")
	}

	// A session listed by two fronts (its client took it from one to the
	// other) counts once: at a quota of 1, the second front may go on
	// with it, and not start another.
	m := "moved"
	if !d.admit(t, m, "s", 1) {
		t.Fatal(`"moved"'s first session was refused`)
	}
	b2 := newTestFront(t, c, ns, "b2")
	defer b2.Close()
	if !b2.admit(t, m, "s", 1) {
		t.Errorf("the same session, taken over by another front, was refused at a quota of 1: %v", recorded(t, c, ns, m))
	}
	if b2.admit(t, m, "t", 1) {
		t.Errorf("a second session was admitted at a quota of 1: %v", recorded(t, c, ns, m))
	}

	// A front that dies (stops renewing, deletes nothing) stops counting
	// once its Lease lapses.
	e := newTestFront(t, c, ns, "e")
	q := "dying"
	if !e.admit(t, q, "one", 1) {
		t.Fatal(`"dying"'s first session was refused`)
	}
	if d.admit(t, q, "two", 1) {
		t.Fatal("a second session past a quota of 1 was admitted")
	}
	close(e.stop)
	<-e.done
	e.hold.cancel()
	<-e.hold.done
	waitFor(t, func() bool { return d.admit(t, q, "two", 1) })
	if rec := recorded(t, c, ns, q); len(rec["e"]) != 0 {
		t.Errorf("the dead front's names were kept: %v", rec)
	}
	d.Close()
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(200 * time.Millisecond)
	}
}
