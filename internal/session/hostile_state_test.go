package session_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// stallingSave is a cell whose next save stalls: pickling its global
// calls a __reduce__ that touches mark, then waits until release exists.
// A box can do this to every save of itself; it must hold up no one else.
func stallingSave(mark, release string) string {
	return fmt.Sprintf(`class Stall:
    def __reduce__(self):
        import os, time
        open(%[1]q, "w").close()
        while not os.path.exists(%[2]q):
            time.sleep(0.02)
        return (int, ())
stall = Stall()`, mark, release)
}

// A box that stalls its own snapshot holds up no other principal's.
func TestSnapshotStallIsolated(t *testing.T) {
	mgr := withSnapshots(t, session.Options{Snapshots: session.SnapshotOptions{StateDir: t.TempDir()}})
	dir := t.TempDir()
	mark, release := filepath.Join(dir, "mark"), filepath.Join(dir, "release")
	defer os.WriteFile(release, nil, 0o600)
	ctx := context.Background()
	slow := getSessionAs(t, mgr, "slow", "s")
	run(t, slow, stallingSave(mark, release))
	stalled := make(chan error, 1)
	go func() { _, err := slow.Snapshot(ctx, "stuck"); stalled <- err }()
	waitUntil(t, exists(mark), "the stalling save to start")

	other := getSessionAs(t, mgr, "other", "s")
	run(t, other, "x = 1")
	finishes(t, "another principal's snapshot while one box stalls its own", func() {
		if _, err := other.Snapshot(ctx, "mine"); err != nil {
			t.Errorf("another principal's snapshot: %v", err)
		}
	})
	select {
	case err := <-stalled:
		t.Fatalf("the stalled save ended before it was released: %v", err)
	default:
	}
	os.WriteFile(release, nil, 0o600)
	select {
	case err := <-stalled:
		if err != nil {
			t.Errorf("the stalled save, once released: %v", err)
		}
	case <-time.After(liveness):
		t.Fatal("the stalled save does not end once released")
	}
}

// needDill skips a test of state-level snapshots on a python without dill.
func needDill(t *testing.T) string {
	t.Helper()
	py := sessiontest.Python(t)
	if exec.Command(py, "-c", "import dill").Run() != nil {
		t.Skip("needs python3-dill")
	}
	return py
}

// One principal's stalled saves hold up neither another principal's
// hibernation nor the reaper: more of its sessions stall than the reaper
// saves at once, and another principal's idle session is still saved.
func TestReaperStallIsolated(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: needDill(t)})
	dir := t.TempDir()
	mark, release := filepath.Join(dir, "mark"), filepath.Join(dir, "release")
	defer os.WriteFile(release, nil, 0o600)
	mgr := hibernating(t, b, t.TempDir(), session.HibernateOptions{After: 300 * time.Millisecond, CheckpointEvery: -1, SaveTimeout: 10 * time.Minute}, session.Options{})
	for i := range 5 {
		hibRun(t, mgr, "slow", fmt.Sprintf("s%d", i), stallingSave(mark, release))
	}
	waitUntil(t, exists(mark), "a stalling save to start")
	hibRun(t, mgr, "other", "s", "x = 1")
	waitUntil(t, func() bool { return stateOf(mgr, "other", "s").State == session.StateHibernated },
		"another principal's idle session to be hibernated while one principal's saves stall")
	os.WriteFile(release, nil, 0o600)
	for i := range 5 {
		name := fmt.Sprintf("s%d", i)
		waitUntil(t, func() bool { return stateOf(mgr, "slow", name).State == session.StateHibernated },
			"the stalled sessions to be hibernated once released")
	}
}
