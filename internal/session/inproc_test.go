package session_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// withPython is inProcess with boxes that run a python kernel.
func withPython(t *testing.T, opts session.Options) (*session.Manager, *sessiontest.Backend) {
	t.Helper()
	b := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
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

func getSession(t *testing.T, mgr *session.Manager, name string) *session.Session {
	t.Helper()
	s, err := mgr.Get("local", name)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSessionFirstBoxFromPool checks that a new session's box is one the
// pool made ahead of time: it already holds the preloaded modules.
func TestSessionFirstBoxFromPool(t *testing.T) {
	mgr, b := withPython(t, session.Options{PoolSize: 1, Preload: []string{"json"}})
	waitUntil(t, func() bool { return b.Created() == 1 }, "the pool to make its box")
	s := getSession(t, mgr, "first")
	out, err := s.RunPython(context.Background(), "import sys; 'json' in sys.modules", liveness)
	if err != nil || out.Result["text/plain"] != "True" || !out.Fresh {
		t.Fatalf("first call: %v %+v", err, out)
	}
	if out, err := s.RunPython(context.Background(), "1", liveness); err != nil || out.Fresh {
		t.Errorf("second call: %v %+v", err, out)
	}
}

// TestTimeoutInterruptKeepsState: a cell past its time limit is
// interrupted; the session keeps its kernel and its variables.
func TestTimeoutInterruptKeepsState(t *testing.T) {
	mgr, b := withPython(t, session.Options{Grace: liveness})
	s := getSession(t, mgr, "slow")
	ctx := context.Background()
	if _, err := s.RunPython(ctx, "kept = 41", liveness); err != nil {
		t.Fatal(err)
	}
	out, err := s.RunPython(ctx, "while True: pass", 200*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if !out.TimedOut || out.Restarted || out.Error == nil || out.Error.Name != "KeyboardInterrupt" ||
		!strings.Contains(out.Note, "the call ran past its time limit of 200ms") || !strings.Contains(out.Note, "the session's state is kept") {
		t.Errorf("an interrupted cell: %+v %+v", out, out.Error)
	}
	if out, err := s.RunPython(ctx, "kept + 1", liveness); err != nil || out.Result["text/plain"] != "42" || out.Fresh {
		t.Errorf("state after the interrupt: %v %+v", err, out)
	}
	if n := b.Created(); n != 1 {
		t.Errorf("%d boxes made; the interrupt must not replace the box", n)
	}
}

// TestTimeoutGraceDestroys: a cell that ignores the interrupt is given the
// grace period, then its box is destroyed; the next call starts fresh.
func TestTimeoutGraceDestroys(t *testing.T) {
	mgr, b := withPython(t, session.Options{Grace: 300 * time.Millisecond})
	s := getSession(t, mgr, "stubborn")
	ctx := context.Background()
	start := time.Now()
	out, err := s.RunPython(ctx, "kept = 1\nimport signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass", 200*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if !out.TimedOut || !out.Restarted || out.Error == nil || out.Error.Name != "Timeout" || !strings.Contains(out.Note, "did not stop when interrupted") {
		t.Errorf("an uninterruptible cell: %+v %+v", out, out.Error)
	}
	if d := time.Since(start); d < 500*time.Millisecond {
		t.Errorf("the box was destroyed after %v, before the timeout and the grace period had passed", d)
	}
	waitUntil(t, func() bool { return b.Live() == 0 }, "the stubborn box to be destroyed")
	out, err = s.RunPython(ctx, "'kept' in dir()", liveness)
	if err != nil || out.Result["text/plain"] != "False" || !out.Fresh {
		t.Errorf("after the restart: %v %+v", err, out)
	}
}

// TestBoxDeath: a box that dies during a call gives that call a
// SandboxDied result; one that dies between calls is replaced, and the
// next call says the earlier state is gone.
func TestBoxDeath(t *testing.T) {
	mgr, b := withPython(t, session.Options{})
	s := getSession(t, mgr, "mortal")
	ctx := context.Background()
	if _, err := s.RunPython(ctx, "kept = 1", liveness); err != nil {
		t.Fatal(err)
	}
	b.Kill()
	waitUntil(t, func() bool { return b.Live() == 0 }, "the killed box to be gone")
	out, err := s.RunPython(ctx, "'kept' in dir()", liveness)
	if err != nil || out.Result["text/plain"] != "False" || !out.Fresh || !strings.Contains(out.Note, "previous sandbox died between calls") {
		t.Errorf("the call after the box died: %v %+v", err, out)
	}

	hold, release := holdCmd(t)
	defer release()
	started := filepath.Join(t.TempDir(), "started")
	ran := make(chan *session.Outcome, 1)
	go func() {
		out, err := s.RunShell(ctx, "touch "+started+"; "+hold, liveness)
		if err != nil {
			t.Error(err)
		}
		ran <- out
	}()
	waitUntil(t, func() bool { _, err := os.Stat(started); return err == nil }, "the call to run")
	b.Kill()
	select {
	case out := <-ran:
		if out == nil || !out.Restarted || out.Error == nil || out.Error.Name != "SandboxDied" || !strings.Contains(out.Note, "the sandbox died") {
			t.Errorf("a call whose box died: %+v", out)
		}
	case <-time.After(liveness):
		t.Fatal("the call hangs after its box died")
	}
	if out, err := s.RunShell(ctx, "echo again", liveness); err != nil || out.Stdout.Text != "again\n" || !out.Fresh {
		t.Errorf("after the death: %v %+v", err, out)
	}
}

// TestIdleReaper: a session unused for IdleTTL is destroyed with its box;
// one in use is not.
func TestIdleReaper(t *testing.T) {
	const ttl = 200 * time.Millisecond
	mgr, b := inProcess(t, session.Options{IdleTTL: ttl})
	ctx := context.Background()
	idle, busy := getSession(t, mgr, "idle"), getSession(t, mgr, "busy")
	if _, err := idle.RunShell(ctx, "true", liveness); err != nil {
		t.Fatal(err)
	}
	hold, release := holdCmd(t)
	defer release()
	held := make(chan error, 1)
	go func() { _, err := busy.RunShell(ctx, hold, liveness); held <- err }()
	waitUntil(t, func() bool { return b.Live() == 2 }, "both sessions to hold a box")
	waitUntil(t, func() bool { return strings.Join(mgr.Sessions("local"), ",") == "busy" }, "the idle session to expire")
	waitUntil(t, func() bool { return b.Live() == 1 }, "the idle session's box to be destroyed")
	time.Sleep(2 * ttl)
	if got := mgr.Sessions("local"); len(got) != 1 {
		t.Errorf("a session with a call running was reaped: %v", got)
	}
	release()
	if err := <-held; err != nil {
		t.Errorf("the busy session's call: %v", err)
	}
	// Used again under its name, an expired session starts afresh.
	again := getSession(t, mgr, "idle")
	if out, err := again.RunShell(ctx, "echo back", liveness); err != nil || !out.Fresh {
		t.Errorf("an expired session used again: %v %+v", err, out)
	}
}

// TestPoolRace: many sessions started at once each get a box of their own
// from the pool or made for them, and no box outlives the manager.
func TestPoolRace(t *testing.T) {
	const n = 16
	mgr, b := inProcess(t, session.Options{PoolSize: 3, PoolWorkers: 3, MaxSessions: n, MaxSessionsPerPrincipal: n})
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := mgr.Get("local", fmt.Sprint("s", i))
			if err != nil {
				errs <- err
				return
			}
			// Through the file tools, not a shell's output: this is about
			// which box a session gets.
			ctx := context.Background()
			var files []agentproto.FileInfo
			var data []byte
			err = s.WithBox(ctx, func(box sandbox.Sandbox) error {
				if err := box.WriteFile(ctx, "mine", []byte(fmt.Sprint(i))); err != nil {
					return err
				}
				if files, err = box.ListFiles(ctx, ""); err != nil {
					return err
				}
				data, _, err = box.ReadFile(ctx, "mine", 100)
				return err
			})
			if err == nil && (len(files) != 1 || string(data) != fmt.Sprint(i)) {
				err = fmt.Errorf("session s%d shares its workspace: %d files, mine holds %q", i, len(files), data)
			}
			errs <- err
		}()
	}
	finishes(t, "the sessions", wg.Wait)
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if c, l := b.Created(), b.Live(); l < n || c < n {
		t.Errorf("%d sessions hold %d live boxes of %d made", n, l, c)
	}
	for i := range n {
		mgr.Reset("local", fmt.Sprint("s", i))
	}
	if _, err := mgr.Get("local", "late"); err != nil {
		t.Errorf("after every session was reset: %v", err)
	}
}
