package boxpolicy

import (
	"testing"

	"golang.org/x/sys/unix"
)

// TestRlimitResources: the table's numbers are the kernel's, as x/sys
// knows them for the architecture under test, and every rlimit a plan
// holds is in it.
func TestRlimitResources(t *testing.T) {
	for name, want := range map[string]int{
		"RLIMIT_CORE":   unix.RLIMIT_CORE,
		"RLIMIT_NOFILE": unix.RLIMIT_NOFILE,
		"RLIMIT_NPROC":  unix.RLIMIT_NPROC,
	} {
		if got, ok := RlimitResource(name); !ok || got != want {
			t.Errorf("RlimitResource(%q) = %d, %v; want %d", name, got, ok, want)
		}
	}
	if len(rlimitResources) != 3 {
		t.Errorf("the table has %d entries, the test checks 3: check the new ones against x/sys", len(rlimitResources))
	}
	for _, r := range New(Limits{Pids: 1, OpenFiles: 1}, 0, 0).Rlimits {
		if _, ok := RlimitResource(r.Name); !ok {
			t.Errorf("the plan names %s, which the table lacks", r.Name)
		}
	}
	if _, ok := RlimitResource("RLIMIT_AS"); ok {
		t.Error("RLIMIT_AS is in the table")
	}
}
