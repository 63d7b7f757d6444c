//go:build linux && !kiln_benchknobs

package jail

import (
	"bytes"
	"testing"
)

// In a normal build no environment turns a hardening measure off: only a
// binary built with -tags kiln_benchknobs reads KILN_BENCH_WEAKEN.
func TestBenchKnobsAbsentFromNormalBuilds(t *testing.T) {
	t.Setenv("KILN_BENCH_WEAKEN", "seccomp,landlock,cgroups")
	if w := benchWeakening(); w != (weakening{}) {
		t.Fatalf("benchWeakening() = %+v in a normal build, want nothing off", w)
	}
	prog := []byte{1, 2, 3, 4, 5, 6, 7, 8}
	ll := &landlockPlan{Handled: 7}
	p := weaken(&zygotePlan{Seccomp: prog, Landlock: ll})
	if !bytes.Equal(p.Seccomp, prog) || p.Landlock != ll {
		t.Fatalf("weaken changed the plan in a normal build: %+v", p)
	}
}
