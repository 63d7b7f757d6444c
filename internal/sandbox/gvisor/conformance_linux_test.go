package gvisor

import (
	"testing"

	"kiln/internal/sandbox/sandboxtest"
)

// gVisor does not re-execute kiln, so its tests need no TestMain.

// conformance is how the suite runs on gVisor. gVisor has no OOM killer
// inside the sandbox: a box over its memory limit is killed whole by the
// host cgroup (see sentryMemSlack), and the session layer replaces it.
var conformance = sandboxtest.Options{MemoryBombKillsBox: true}

// The hostile battery checks after every case that its boxes left nothing.
var _ sandboxtest.LeakChecker = (*Backend)(nil)

func TestConformanceCold(t *testing.T) {
	b := newTestBackend(t, Options{Cold: true, Agent: sandboxtest.BuildAgent(t)})
	sandboxtest.RunWith(t, b, conformance)
}

func TestConformanceWarm(t *testing.T) {
	b := newTestBackend(t, Options{Agent: sandboxtest.BuildAgent(t)})
	sandboxtest.RunWith(t, b, conformance)
}
