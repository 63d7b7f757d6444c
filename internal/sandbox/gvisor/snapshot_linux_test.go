package gvisor

import (
	"testing"

	"kiln/internal/sandbox/sandboxtest"
)

// State-level snapshots on gVisor, through the same agent as the jail's.
func TestSnapshots(t *testing.T) {
	sandboxtest.RunSnapshots(t, newTestBackend(t, Options{Cold: true, Agent: sandboxtest.BuildAgent(t)}))
}
