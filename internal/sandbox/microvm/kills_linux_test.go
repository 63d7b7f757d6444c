package microvm_test

import (
	"testing"

	"kiln/internal/sandbox/microvm"
	"kiln/internal/session/sessiontest"
)

// TestKillsNameTheLimit: the memory and pids limits of a microVM are
// enforced by its guest kernel, which the host does not see into; a kill
// there names the memory limit without claiming it was the cause, and a
// refused fork stays the code's own error.
func TestKillsNameTheLimit(t *testing.T) {
	b := newBackend(t, microvm.Options{})
	sessiontest.RunKills(t, b, sessiontest.KillOptions{Scale: 10})
}
