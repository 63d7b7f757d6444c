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
