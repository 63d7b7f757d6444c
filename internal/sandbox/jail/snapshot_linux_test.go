package jail_test

import (
	"testing"

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
