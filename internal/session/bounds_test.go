package session_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// liveness bounds how long a test waits for something that must happen;
// reaching it is a hang, not slowness.
const liveness = 30 * time.Second

func waitUntil(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(liveness)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// finishes runs f and fails the test if it does not return in time.
func finishes(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(liveness):
		t.Fatalf("%s hangs", what)
	}
}

func inProcess(t *testing.T, opts session.Options) (*session.Manager, *sessiontest.Backend) {
	t.Helper()
	b := sessiontest.New(t, nil)
	opts.Backend = b
	mgr := session.NewManager(opts)
	t.Cleanup(func() {
		finishes(t, "closing the manager", mgr.Close)
		if n := b.Live(); n != 0 {
			t.Errorf("%d boxes outlive the manager", n)
		}
	})
	return mgr, b
}

// TestSessionQuotaPerPrincipal: one principal filling its quota leaves
// room for the others, and each refusal names its limit and its flag.
func TestSessionQuotaPerPrincipal(t *testing.T) {
	mgr, _ := inProcess(t, session.Options{})
	var err error
	n := 0
	for ; n < 1000 && err == nil; n++ {
		_, err = mgr.Get("greedy", fmt.Sprint("s", n))
	}
	if !errors.Is(err, session.ErrTooMany) {
		t.Fatalf("the greedy principal got %d sessions; the last error %v", n, err)
	}
	if !strings.Contains(err.Error(), "--max-sessions-per-principal") {
		t.Errorf("the refusal does not name its flag: %v", err)
	}
	if _, err := mgr.Get("other", "mine"); err != nil {
		t.Fatalf("after the greedy principal took %d sessions, another principal was refused: %v", n-1, err)
	}

	// The server's own cap still holds across principals.
	mgr, _ = inProcess(t, session.Options{MaxSessions: 3, MaxSessionsPerPrincipal: 2})
	for _, k := range [][2]string{{"a", "1"}, {"a", "2"}, {"b", "1"}} {
		if _, err := mgr.Get(k[0], k[1]); err != nil {
			t.Fatal(err)
		}
	}
	_, err = mgr.Get("c", "1")
	if !errors.Is(err, session.ErrTooMany) || !strings.Contains(err.Error(), "--max-sessions)") {
		t.Errorf("past the server's cap: %v", err)
	}
	if _, err := mgr.Get("a", "1"); err != nil {
		t.Errorf("an existing session is refused at the cap: %v", err)
	}
}

// holdCmd is a shell command that keeps its box busy until release
// creates the file it waits for.
func holdCmd(t *testing.T) (cmd string, release func()) {
	dir := t.TempDir()
	f := filepath.Join(dir, "go")
	var once sync.Once
	return fmt.Sprintf("until [ -e %s ]; do sleep 0.02; done", f), func() {
		once.Do(func() { os.WriteFile(f, nil, 0o644) })
	}
}

// TestBoxCapPerCall: concurrent per-call calls never hold more boxes than
// the cap, the pool's included; the calls beyond it wait, and a call that
// finds no box within the wait gets ErrBusy, not an unbounded new box.
func TestBoxCapPerCall(t *testing.T) {
	const max, calls = 3, 24
	mgr, b := inProcess(t, session.Options{Mode: session.ModePerCall, MaxBoxes: max, BoxWait: liveness, PoolSize: 2})
	var wg sync.WaitGroup
	errs := make(chan error, calls)
	for range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, _, err := mgr.RunOnce(context.Background(), session.Shell, "sleep 0.05; echo ok", nil, liveness)
			if err == nil && out.Stdout.Text != "ok\n" {
				err = fmt.Errorf("output %q", out.Stdout.Text)
			}
			errs <- err
		}()
	}
	finishes(t, "the calls", wg.Wait)
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("a call under the cap failed: %v", err)
		}
	}
	if p := b.Peak(); p > max {
		t.Errorf("%d concurrent calls made %d live boxes; the cap is %d", calls, p, max)
	}

	// Every box busy: the next call waits BoxWait, then is told so.
	mgr, b = inProcess(t, session.Options{Mode: session.ModePerCall, MaxBoxes: 2, BoxWait: 100 * time.Millisecond})
	hold, release := holdCmd(t)
	defer release()
	var holders sync.WaitGroup
	for range 2 {
		holders.Add(1)
		go func() {
			defer holders.Done()
			mgr.RunOnce(context.Background(), session.Shell, hold, nil, liveness)
		}()
	}
	waitUntil(t, func() bool { return b.Live() == 2 }, "two boxes to be busy")
	_, _, err := mgr.RunOnce(context.Background(), session.Shell, "echo never", nil, liveness)
	if !errors.Is(err, session.ErrBusy) || !strings.Contains(err.Error(), "--max-boxes") || !strings.Contains(err.Error(), "retry") {
		t.Errorf("a call past the cap: %v", err)
	}
	if p := b.Peak(); p > 2 {
		t.Errorf("%d live boxes; the cap is 2", p)
	}
	release()
	finishes(t, "the holding calls", holders.Wait)
	if out, _, err := mgr.RunOnce(context.Background(), session.Shell, "echo again", nil, liveness); err != nil || out.Stdout.Text != "again\n" {
		t.Errorf("after the boxes came free: %v %+v", err, out)
	}
}

// TestBoxCapSessionsAndPool: the pool fills only what the cap leaves, gives
// its boxes to calls, and sessions past the cap are told the server is busy
// until one is reset.
func TestBoxCapSessionsAndPool(t *testing.T) {
	mgr, b := inProcess(t, session.Options{MaxBoxes: 2, PoolSize: 8, PoolWorkers: 4, BoxWait: 100 * time.Millisecond})
	waitUntil(t, func() bool { return b.Live() == 2 }, "the pool to fill what the cap allows")
	ctx := context.Background()
	for _, name := range []string{"a", "b"} {
		s, err := mgr.Get("p", name)
		if err != nil {
			t.Fatal(err)
		}
		if out, err := s.RunShell(ctx, "echo hi", liveness); err != nil || out.Stdout.Text != "hi\n" {
			t.Fatalf("session %s: %v %+v", name, err, out)
		}
	}
	c, err := mgr.Get("p", "c")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.RunShell(ctx, "echo hi", liveness); !errors.Is(err, session.ErrBusy) || !strings.Contains(err.Error(), "reset_session") {
		t.Errorf("a third session past a cap of 2: %v", err)
	}
	finishes(t, "reset", func() { mgr.Reset("p", "a") })
	if out, err := c.RunShell(ctx, "echo hi", liveness); err != nil || out.Stdout.Text != "hi\n" {
		t.Errorf("after a reset freed a box: %v %+v", err, out)
	}
	if p := b.Peak(); p > 2 {
		t.Errorf("%d live boxes; the cap is 2", p)
	}
}

// TestResetStuckSession: a box whose agent stopped answering hangs a file
// call that holds the session; reset returns anyway, destroys the box (it
// is counted until it is gone), and the stuck call fails.
func TestResetStuckSession(t *testing.T) {
	mgr, b := inProcess(t, session.Options{MaxBoxes: 1, BoxWait: liveness})
	s, err := mgr.Get("p", "stuck")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := s.RunShell(ctx, "true", liveness); err != nil {
		t.Fatal(err)
	}
	b.Freeze()
	listed := make(chan error, 1)
	go func() {
		listed <- s.WithBox(ctx, func(box sandbox.Sandbox) error {
			_, err := box.ListFiles(ctx, "")
			return err
		})
	}()
	waitUntil(t, func() bool { return b.Stuck() > 0 }, "the call to reach the stopped agent")
	finishes(t, "reset_session of a stuck session", func() {
		if !mgr.Reset("p", "stuck") {
			t.Error("reset found no session")
		}
	})
	select {
	case err := <-listed:
		if err == nil {
			t.Error("the stuck call succeeded")
		}
	case <-time.After(liveness):
		t.Fatal("the stuck call still hangs after reset")
	}
	waitUntil(t, func() bool { return b.Live() == 0 && mgr.LiveBoxes() == 0 }, "the stuck box to be destroyed")

	// The slot came back: a cap of 1 lets the next session run.
	s2, err := mgr.Get("p", "next")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := s2.RunShell(ctx, "echo fresh", liveness); err != nil || out.Stdout.Text != "fresh\n" {
		t.Errorf("after reset: %v %+v", err, out)
	}

	// A stuck call does not hold up the server's close either.
	b.Freeze()
	go s2.WithBox(ctx, func(box sandbox.Sandbox) error { _, err := box.ListFiles(ctx, ""); return err })
	waitUntil(t, func() bool { return b.Stuck() > 0 }, "the second call to reach the stopped agent")
}

// TestWarnsWhenBoxesOvercommitMemory: the live-box cap times the memory
// limit beyond the host's memory is logged at start.
func TestWarnsWhenBoxesOvercommitMemory(t *testing.T) {
	if session.HostMemory() == 0 {
		t.Skip("the host's memory is unknown here (no /proc/meminfo)")
	}
	for _, c := range []struct {
		boxes int
		warn  bool
	}{{1 << 20, true}, {1, false}} {
		var logs bytes.Buffer
		_, _ = inProcess(t, session.Options{
			MaxBoxes: c.boxes, Limits: sandbox.Limits{MemoryBytes: 64 << 20},
			Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		})
		if got := strings.Contains(logs.String(), "more memory than the host has"); got != c.warn {
			t.Errorf("%d boxes of 64 MiB: warned %v, want %v: %s", c.boxes, got, c.warn, logs.String())
		}
	}
}

// TestCloseStuckPerCall: closing the server destroys a per-call box whose
// agent stopped answering mid-call, and the call ends.
func TestCloseStuckPerCall(t *testing.T) {
	b := sessiontest.New(t, nil)
	mgr := session.NewManager(session.Options{Backend: b, Mode: session.ModePerCall})
	hold, release := holdCmd(t)
	ran := make(chan error, 1)
	go func() {
		_, _, err := mgr.RunOnce(context.Background(), session.Shell, hold, nil, 5*time.Minute)
		ran <- err
	}()
	waitUntil(t, func() bool { return b.Live() == 1 }, "the call to get its box")
	b.Freeze()
	release()
	finishes(t, "closing the server with a stuck per-call box", mgr.Close)
	select {
	case <-ran:
	case <-time.After(liveness):
		t.Fatal("the stuck call still hangs after close")
	}
	waitUntil(t, func() bool { return b.Live() == 0 }, "the stuck box to be destroyed")
}

// TestLimitReadsPerCall: a session call reads its box's limit counters
// twice, before and after (on the cluster backend each read is a round
// trip to the node); the session keeps the second for the next call
// rather than reading them again. The first call is the control: the
// backend counts reads at all.
func TestLimitReadsPerCall(t *testing.T) {
	mgr, b := inProcess(t, session.Options{})
	s, err := mgr.Get("p", "reads")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := s.RunShell(ctx, "true", time.Minute); err != nil {
		t.Fatal(err)
	}
	if b.LimitReads() == 0 {
		t.Fatal("control: the backend counted no read of the limit counters")
	}
	before := b.LimitReads()
	for range 5 {
		if _, err := s.RunShell(ctx, "true", time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	if n := b.LimitReads() - before; n != 10 {
		t.Errorf("5 session calls read the limit counters %d times, want 10 (2 each)", n)
	}
}
