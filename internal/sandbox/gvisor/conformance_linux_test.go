package gvisor

import (
	"testing"

	"kiln/internal/sandbox/sandboxtest"
)

// gVisor does not re-execute kiln, so its tests need no TestMain.

// conformance is how the suite runs on gVisor. gVisor has no OOM killer
// inside the sandbox: a box over its memory limit is killed whole by the
// host cgroup (see sentryMemSlack), and the session layer replaces it.
// What runsc makes of the box plan's mounts and masks is told by Options,
// with the reasons (runsc's ParseMountOptions, proc's tasks.go).
var conformance = sandboxtest.Options{
	MemoryBombKillsBox: true,
	NoInodeCap:         gvisorNoInodeCap,
	NoNodev:            gvisorNoNodev,
	NoProcMasks:        gvisorNoProcMasks,
}

// Why gVisor's boxes differ from the box plan, for the plan case.
const (
	gvisorNoInodeCap  = "gVisor's tmpfs refuses nr_inodes (tmpfsMount leaves it out); its files count against the box's memory limit"
	gvisorNoNodev     = "runsc ignores the nodev mount option; the only devices in a gVisor box are the sentry's own emulated ones, never the host's"
	gvisorNoProcMasks = "runsc ignores the OCI spec's maskedPaths; the box's /proc is the sentry's own, which has no kcore, timer_list or keys and whose sysrq-trigger is an empty file that does nothing"
)

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
