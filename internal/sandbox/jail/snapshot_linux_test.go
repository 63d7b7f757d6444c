package jail_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
)

func TestSnapshots(t *testing.T) {
	b := newBackend(t)
	defer b.Close()
	sandboxtest.RunSnapshots(t, b)
}

func TestSnapshotsZygote(t *testing.T) {
	sandboxtest.RunSnapshots(t, newZygoteBackend(t))
}

// The conformance suite, hostile battery included, on restored boxes: a
// box with a snapshot loaded keeps every restriction of a fresh one.
func TestConformanceRestored(t *testing.T) {
	b := newBackend(t)
	defer b.Close()
	sandboxtest.RunWith(t, sandboxtest.Restoring(b, sandboxtest.StateSnapshot(t, b)), sandboxtest.Options{HostProcesses: true})
}

// A state larger than the box's /tmp, where it is packed, is refused with
// an error that says so, and the box keeps running.
func TestSnapshotTmpFull(t *testing.T) {
	b := newBackend(t)
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "snap-full", Limits: sandbox.Limits{TmpBytes: 8 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	if res, err := box.RunPython(ctx, "big = b'x' * (16 << 20)", sandbox.ExecOptions{}); err != nil || res.Error != nil {
		t.Fatalf("%v %+v", err, res)
	}
	dir := t.TempDir()
	_, err = box.(sandbox.Snapshotter).Snapshot(ctx, dir)
	if err == nil || !strings.Contains(err.Error(), "/tmp, where it is packed, has no room") {
		t.Fatalf("snapshot over /tmp: %v", err)
	}
	res, err := box.RunPython(ctx, "import os; print(len(big), [n for n in os.listdir('/tmp') if n.startswith('.kiln-')])", sandbox.ExecOptions{})
	if err != nil || res.Error != nil || strings.TrimSpace(res.Stdout.Text) != "16777216 []" {
		t.Errorf("after the refused snapshot: %v %+v", err, res)
	}
}
