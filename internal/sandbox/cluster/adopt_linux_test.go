package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/cluster"
	"kiln/internal/session"
)

// printed runs code in box and returns its stdout, trimmed.
func printed(t *testing.T, ctx context.Context, box sandbox.Sandbox, code string) string {
	t.Helper()
	res, err := box.RunPython(ctx, code, sandbox.ExecOptions{})
	if err != nil {
		t.Fatalf("%s: %v", code, err)
	}
	return strings.TrimSpace(res.Stdout.Text)
}

// TestAdopt: a box bound to a session is taken over by another front, from
// a live front or from one that went without closing it (within the
// node's orphan grace), kernel state kept; a box closed on purpose, an
// unbound box whose front went, and an orphan whose grace ran out are
// destroyed, and no front adopts them.
func TestAdopt(t *testing.T) {
	dir := certs(t)
	const grace = 2 * time.Second
	addr, n := startNode(t, dir, cluster.NodeOptions{OrphanGrace: grace})
	fa, fb := front(t, dir, addr), front(t, dir, addr)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const key = "alice\x00s"

	a, err := fa.Create(ctx, sandbox.Spec{ID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := fa.Bind(ctx, a, key); err != nil {
		t.Fatal(err)
	}
	printed(t, ctx, a, "x = 41")
	// Control: another key, another principal's session of the same
	// name, holds no box.
	for _, other := range []string{"alice\x00t", "bob\x00s"} {
		if box, err := fb.Adopt(ctx, other); !errors.Is(err, sandbox.ErrNoBox) {
			t.Fatalf("adopting %q, bound to no box: %v %v", other, box, err)
		}
	}

	// From a live front: the first front's connection is closed.
	b, err := fb.Adopt(ctx, key)
	if err != nil {
		t.Fatalf("adopting from a live front: %v", err)
	}
	if got := printed(t, ctx, b, "x += 1; print(x)"); got != "42" {
		t.Fatalf("the adopted box printed %q, want 42: its kernel was not kept", got)
	}
	waitFor(t, func() bool { return !alive(a) })
	if st := n.Status(); st.Boxes != 1 {
		t.Fatalf("the node counts %d boxes after an adoption, want 1", st.Boxes)
	}

	// From a front that went: the box waits for the next.
	cluster.Abandon(b)
	waitFor(t, func() bool { return !alive(b) })
	time.Sleep(200 * time.Millisecond)
	if st := n.Status(); st.Boxes != 1 {
		t.Fatalf("the node counts %d boxes once the front went, want 1 (kept for adoption)", st.Boxes)
	}
	c, err := fa.Adopt(ctx, key)
	if err != nil {
		t.Fatalf("adopting an orphan: %v", err)
	}
	if got := printed(t, ctx, c, "print(x)"); got != "42" {
		t.Fatalf("the orphan printed %q, want 42", got)
	}

	// Closed on purpose: destroyed at once, for no one to adopt.
	c.Close()
	waitFor(t, func() bool { return n.Status().Boxes == 0 })
	if box, err := fb.Adopt(ctx, key); !errors.Is(err, sandbox.ErrNoBox) {
		t.Fatalf("adopting a box its front closed: %v %v", box, err)
	}

	// Unbound, its front gone: destroyed at once (per-call and pool boxes).
	u, err := fa.Create(ctx, sandbox.Spec{ID: "u"})
	if err != nil {
		t.Fatal(err)
	}
	cluster.Abandon(u)
	waitFor(t, func() bool { return n.Status().Boxes == 0 })

	// An orphan no front adopts is destroyed after the grace.
	o, err := fa.Create(ctx, sandbox.Spec{ID: "o"})
	if err != nil {
		t.Fatal(err)
	}
	if err := fa.Bind(ctx, o, key); err != nil {
		t.Fatal(err)
	}
	cluster.Abandon(o)
	gone := time.Now()
	time.Sleep(grace / 2)
	if st := n.Status(); st.Boxes != 1 {
		t.Fatalf("the orphan went before its grace: %d boxes", st.Boxes)
	}
	waitFor(t, func() bool { return n.Status().Boxes == 0 })
	t.Logf("the orphan was destroyed %s after its front went (grace %s)", time.Since(gone).Round(100*time.Millisecond), grace)
	if box, err := fb.Adopt(ctx, key); !errors.Is(err, sandbox.ErrNoBox) {
		t.Fatalf("adopting an expired orphan: %v %v", box, err)
	}
	if left := localJail(t).Leftovers(); len(left) > 0 {
		t.Errorf("the jail holds %v", left)
	}
}

// TestBindRefused: a bind with a malformed key is refused and binds
// nothing; an adopt with one is refused before anything is looked up.
func TestBindRefused(t *testing.T) {
	dir := certs(t)
	addr, n := startNode(t, dir, cluster.NodeOptions{OrphanGrace: time.Minute})
	f := front(t, dir, addr)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := f.Create(ctx, sandbox.Spec{ID: "k"})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"", "zz", strings.Repeat("A", 64), strings.Repeat("a", 65)} {
		if err := cluster.BindRaw(ctx, box, k); err == nil {
			t.Errorf("a bind to %q was taken", k)
		}
	}
	cluster.Abandon(box)
	waitFor(t, func() bool { return n.Status().Boxes == 0 })
	if err := cluster.OpenRaw(ctx, f, addr, cluster.Open{Op: cluster.OpAdopt, Key: "../x"}); err == nil {
		t.Error("an adopt with a malformed key was answered")
	}
	if err := cluster.OpenRaw(ctx, f, addr, cluster.Open{Op: cluster.OpAdopt}); err == nil {
		t.Error("an adopt with no key was answered")
	}
	// Control: a well-formed one is answered (it holds nothing).
	if err := cluster.OpenRaw(ctx, f, addr, cluster.Open{Op: cluster.OpAdopt, Key: cluster.SessionKey("x")}); err != nil {
		t.Errorf("control: a well-formed adopt: %v", err)
	}
}

// TestSessionFollowsFront: a session goes on through whichever front its
// client reaches, in the same kernel, and back; another principal's
// session of the same name is not it.
func TestSessionFollowsFront(t *testing.T) {
	dir := certs(t)
	a, _ := startNode(t, dir, cluster.NodeOptions{})
	b, _ := startNode(t, dir, cluster.NodeOptions{})
	mgrs := make([]*session.Manager, 2)
	for i := range mgrs {
		mgrs[i] = session.NewManager(session.Options{Backend: front(t, dir, a, b)})
		defer mgrs[i].Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	run := func(m *session.Manager, principal, code string) *session.Outcome {
		t.Helper()
		return runIn(ctx, t, m, principal, "s", code)
	}
	run(mgrs[0], "alice", "x = 6")
	for i, want := range []string{"42", "43", "44"} {
		out := run(mgrs[(i+1)%2], "alice", "x = x * 7 if x == 6 else x + 1; x")
		if got := out.Result["text/plain"]; got != want {
			t.Fatalf("call %d, on front %d: x is %q (%q, %q), want %s", i+2, (i+1)%2, got, out.Stderr.Text, out.Note, want)
		}
		if out.Note != "" || out.Restarted {
			t.Errorf("call %d: restarted %v, note %q", i+2, out.Restarted, out.Note)
		}
	}
	if out := run(mgrs[1], "bob", "globals().get('x')"); out.Result["text/plain"] != "" && out.Result["text/plain"] != "None" {
		t.Errorf("another principal's session of the same name sees x = %q", out.Result["text/plain"])
	}
}

// noAdopt hides the cluster backend's Adopter, as before sessions
// followed their client: the baseline of BenchmarkSessionStart.
type noAdopt struct{ sandbox.Backend }

// BenchmarkSessionStart is a new session's first call through a front on
// two nodes, with a pool of ready boxes: with adoption the front first
// asks both nodes whether they hold the session's box (they do not), and
// binds the box it takes; without it, it does neither.
func BenchmarkSessionStart(b *testing.B) {
	for _, c := range []struct {
		name  string
		adopt bool
	}{{"adopt", true}, {"no-adopt", false}} {
		b.Run(c.name, func(b *testing.B) {
			dir := certs(b)
			x, _ := startNode(b, dir, cluster.NodeOptions{MaxBoxes: 16})
			y, _ := startNode(b, dir, cluster.NodeOptions{MaxBoxes: 16})
			var backend sandbox.Backend = front(b, dir, x, y)
			if !c.adopt {
				backend = noAdopt{backend}
			}
			mgr := session.NewManager(session.Options{Backend: backend, PoolSize: 2})
			defer mgr.Close()
			ctx := context.Background()
			b.ResetTimer()
			for i := range b.N {
				b.StopTimer()
				time.Sleep(100 * time.Millisecond) // the pool refills
				s, err := mgr.Get("bench", fmt.Sprint("s", i))
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, err := s.RunPython(ctx, "1", time.Minute); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if !mgr.Reset("bench", fmt.Sprint("s", i)) {
					b.Fatal("no session to reset")
				}
				b.StartTimer()
			}
		})
	}
}

// BenchmarkStatus is one status round trip to a node, a new TLS
// connection each: resuming the node's TLS session (the front's default)
// against a full handshake, in the same run.
func BenchmarkStatus(b *testing.B) {
	dir := certs(b)
	addr, _ := startNode(b, dir, cluster.NodeOptions{})
	for _, resume := range []bool{true, false} {
		b.Run(fmt.Sprintf("resume=%v", resume), func(b *testing.B) {
			cfg, err := cluster.FrontTLS(dir)
			if err != nil {
				b.Fatal(err)
			}
			if !resume {
				cfg.ClientSessionCache = nil
			}
			f, err := cluster.New(cluster.Options{Nodes: []string{addr}, TLS: cfg})
			if err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if _, err := f.Status(context.Background(), addr); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestHandOver: a front that stops the ordinary way (SIGTERM: a rolling
// update) leaves its sessions' boxes on their nodes for another front to
// adopt, rather than destroy them; its per-call boxes it destroys as
// before. A box nobody adopts goes at the node's orphan grace.
func TestHandOver(t *testing.T) {
	dir := certs(t)
	a, na := startNode(t, dir, cluster.NodeOptions{OrphanGrace: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	run := func(m *session.Manager, principal, code string) *session.Outcome {
		t.Helper()
		return runIn(ctx, t, m, principal, "s", code)
	}
	first := session.NewManager(session.Options{Backend: front(t, dir, a)})
	run(first, "alice", "x = 41")
	if _, _, err := first.RunOnce(ctx, session.Python, "print('per call')", nil, time.Minute); err != nil {
		t.Fatal(err)
	}
	first.Close()
	// The node ends a box whose front let go of it as it notices.
	deadline := time.Now().Add(10 * time.Second)
	for na.Status().Boxes > 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := na.Status().Boxes; n != 1 {
		t.Errorf("after the first front stopped, its node holds %d boxes, want 1 (the session's)", n)
	}

	second := session.NewManager(session.Options{Backend: front(t, dir, a)})
	defer second.Close()
	out := run(second, "alice", "x + 1")
	if got := out.Result["text/plain"]; got != "42" || out.Note != "" {
		t.Fatalf("after a graceful stop of the session's front, the next front found x = %q (note %q, stderr %q), want 42", got, out.Note, out.Stderr.Text)
	}
}

// runIn runs code in the session name of principal on m.
func runIn(ctx context.Context, t *testing.T, m *session.Manager, principal, name, code string) *session.Outcome {
	t.Helper()
	s, err := m.Get(principal, name)
	if err != nil {
		t.Fatal(err)
	}
	out, err := s.RunPython(ctx, code, time.Minute)
	if err != nil {
		t.Fatalf("%s: %v", code, err)
	}
	return out
}
