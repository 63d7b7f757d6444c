package session_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"kiln/internal/session"
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
