package microvm_test

import (
	"testing"

	"kiln/internal/sandbox/microvm"
	"kiln/internal/sandbox/sandboxtest"
)

// TestSnapshots runs the state-level snapshot suite on clones of a
// template VM, under TCG: the guest image has python3-dill, which the
// agent pickles a session's globals with.
func TestSnapshots(t *testing.T) {
	sandboxtest.RunSnapshots(t, newBackend(t, microvm.Options{}))
}
