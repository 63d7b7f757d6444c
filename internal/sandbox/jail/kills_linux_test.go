package jail_test

import (
	"testing"

	"kiln/internal/session/sessiontest"
)

// TestKillsNameTheLimit: the jail's cgroup counts OOM kills and refused
// forks, so every kill names its limit.
func TestKillsNameTheLimit(t *testing.T) {
	sessiontest.RunKills(t, newBackend(t), sessiontest.KillOptions{OOMCounted: true, PidsCounted: true, Scale: timeoutScale()})
}
