package gvisor

import (
	"testing"

	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session/sessiontest"
)

// TestKillsNameTheLimit: a gVisor box over its memory limit dies whole, and
// runsc removes its cgroup (with the OOM count) as it dies, so the result
// names the limit as a possible cause only; the pids limit is RLIMIT_NPROC inside the gVisor
// kernel, which the host does not see, so a refused fork stays the code's
// own error.
func TestKillsNameTheLimit(t *testing.T) {
	b := newTestBackend(t, Options{Agent: sandboxtest.BuildAgent(t)})
	sessiontest.RunKills(t, b, sessiontest.KillOptions{})
}
