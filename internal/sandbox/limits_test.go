package sandbox

import (
	"math"
	"testing"
)

func TestLimitsWithin(t *testing.T) {
	ceil := Limits{MemoryBytes: 512 << 20, Pids: 64, CPUs: 2, WorkspaceBytes: 1 << 30, TmpBytes: 1 << 20, Inodes: 100, OpenFiles: 512}
	for name, c := range map[string]struct{ asked, want Limits }{
		"nothing asked": {Limits{}, ceil},
		"less": {
			Limits{MemoryBytes: 1 << 20, Pids: 8, CPUs: 0.5, WorkspaceBytes: 1 << 20, TmpBytes: 1 << 10, Inodes: 10, OpenFiles: 64},
			Limits{MemoryBytes: 1 << 20, Pids: 8, CPUs: 0.5, WorkspaceBytes: 1 << 20, TmpBytes: 1 << 10, Inodes: 10, OpenFiles: 64},
		},
		"more":     {Limits{MemoryBytes: 1 << 40, Pids: 1 << 20, CPUs: 64, WorkspaceBytes: 1 << 40, TmpBytes: 1 << 40, Inodes: 1 << 30, OpenFiles: 1 << 20}, ceil},
		"negative": {Limits{MemoryBytes: -1, Pids: -1, CPUs: -1, WorkspaceBytes: -1, TmpBytes: -1, Inodes: -1, OpenFiles: -1}, ceil},
		"NaN CPUs": {Limits{CPUs: math.NaN()}, ceil},
		"Inf CPUs": {Limits{CPUs: math.Inf(1)}, ceil},
	} {
		if got := c.asked.Within(ceil); got != c.want {
			t.Errorf("%s: %+v within %+v = %+v, want %+v", name, c.asked, ceil, got, c.want)
		}
	}
	// A zero ceiling is the defaults.
	if got := (Limits{}).Within(Limits{}); got != DefaultLimits {
		t.Errorf("nothing within nothing = %+v, want the defaults %+v", got, DefaultLimits)
	}
}
