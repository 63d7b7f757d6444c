package session_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"kiln/internal/event"
	"kiln/internal/session"
)

// recorder keeps the events it is told of.
type recorder struct {
	mu     sync.Mutex
	events []event.Event
}

func (r *recorder) Observe(e event.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
}

func (r *recorder) execs() []event.Exec {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []event.Exec
	for _, e := range r.events {
		if x, ok := e.(event.Exec); ok {
			out = append(out, x)
		}
	}
	return out
}

func (r *recorder) sessions() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.events {
		if s, ok := e.(event.Session); ok {
			out = append(out, s.Op+" "+s.Principal+"/"+s.Session)
		}
	}
	return out
}

func (r *recorder) boxes() (created, misses int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.events {
		if b, ok := e.(event.Box); ok {
			if b.PoolMiss {
				misses++
			} else if !b.Err {
				created++
			}
		}
	}
	return
}

// TestObserveExecs checks the result class and limits of each kind of
// ending, as the observer (audit log, metrics) gets them.
func TestObserveExecs(t *testing.T) {
	rec := &recorder{}
	mgr, b := withPython(t, session.Options{Observer: rec, Limits: smallLimits, Grace: 2 * time.Second})
	s := getSession(t, mgr, "obs")
	ctx := context.Background()
	run := func(code string, timeout time.Duration) {
		t.Helper()
		if _, err := s.RunPython(ctx, code, timeout); err != nil {
			t.Fatal(err)
		}
	}
	run("print('hi')", liveness)
	run("1/0", liveness)
	if _, err := s.RunShell(ctx, "echo err >&2; exit 3", liveness); err != nil {
		t.Fatal(err)
	}
	run("import time; time.sleep(30)", 200*time.Millisecond)
	// The memory limit kills the kernel while the cell runs.
	code, started, release := gatedCell(t, "x = 1")
	ran := make(chan struct{})
	go func() { defer close(ran); s.RunPython(ctx, code, liveness) }()
	waitUntil(t, exists(started), "the cell to start")
	b.HitLimits(1, 0)
	release()
	<-ran

	type got struct {
		Lang, Result string
		Limits       []string
		Out, Err     int64
	}
	var all []got
	for _, e := range rec.execs() {
		if e.Principal != "local" || e.Session != "obs" || e.Backend != "inprocess" || e.Box == "" || e.Duration <= 0 {
			t.Errorf("exec event without its identity: %+v", e)
		}
		all = append(all, got{e.Language, e.Result, e.LimitsHit, e.StdoutBytes, e.StderrBytes})
	}
	want := []got{
		{"python", event.ResultOK, nil, 3, 0},
		{"python", event.ResultError, nil, 0, 0},
		{"shell", event.ResultError, nil, 0, 4},
		{"python", event.ResultTimeout, []string{event.LimitTime}, 0, 0},
		{"python", event.ResultOOM, []string{event.LimitMemory}, 0, 0},
	}
	if diff := cmp.Diff(want, all); diff != "" {
		t.Errorf("exec events (-want +got):\n%s", diff)
	}
}

// TestObserveSessionsAndBoxes: create, reset, expire and close are each
// reported once; per-call runs carry the caller's principal; the pool's
// creations and misses are counted.
func TestObserveSessionsAndBoxes(t *testing.T) {
	rec := &recorder{}
	mgr, _ := withPython(t, session.Options{Observer: rec, IdleTTL: 200 * time.Millisecond})
	ctx := context.Background()
	s := getSession(t, mgr, "a")
	getSession(t, mgr, "a") // the same session: no second create
	if _, err := s.RunShell(ctx, "true", liveness); err != nil {
		t.Fatal(err)
	}
	mgr.Reset("local", "a")
	getSession(t, mgr, "b")
	waitUntil(t, func() bool { return slices.Contains(rec.sessions(), "expire local/b") }, "session b to expire")
	getSession(t, mgr, "c")
	mgr.Close()
	want := []string{"create local/a", "reset local/a", "create local/b", "expire local/b", "create local/c", "close local/c"}
	if diff := cmp.Diff(want, rec.sessions()); diff != "" {
		t.Errorf("session events (-want +got):\n%s", diff)
	}

	rec = &recorder{}
	pc, _ := withPython(t, session.Options{Observer: rec, Mode: session.ModePerCall, PoolSize: 1})
	waitUntil(t, func() bool { c, _ := rec.boxes(); return c == 1 }, "the pool to make its box")
	// Four at once on a pool of one: at least three find it empty.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if _, _, err := pc.RunOnce(session.WithPrincipal(ctx, "bob"), session.Shell, "true", nil, liveness); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	execs := rec.execs()
	if len(execs) != 4 {
		t.Fatalf("%d exec events for 4 per-call runs", len(execs))
	}
	for _, e := range execs {
		if e.Principal != "bob" || e.Session != "" || e.Result != event.ResultOK {
			t.Errorf("per-call exec event: %+v", e)
		}
	}
	created, misses := rec.boxes()
	if created < 4 || misses < 3 {
		t.Errorf("%d boxes created and %d pool misses reported after 4 concurrent per-call runs on a pool of 1", created, misses)
	}
}
