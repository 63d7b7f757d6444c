//go:build kiln_benchknobs

package jail

import "testing"

func TestBenchKnobsWeaken(t *testing.T) {
	t.Setenv(WeakenEnv, "seccomp,landlock")
	p := weaken(&zygotePlan{Seccomp: []byte{1, 2, 3, 4, 5, 6, 7, 8}, Landlock: &landlockPlan{Handled: 7}})
	if string(p.Seccomp) != string(allowAll) || p.Landlock != nil {
		t.Fatalf("weaken left seccomp %x, landlock %+v; want the allow-all program and none", p.Seccomp, p.Landlock)
	}
	if w := benchWeakening(); !w.seccomp || !w.landlock || w.cgroups {
		t.Fatalf("benchWeakening() = %+v, want seccomp and landlock", w)
	}
}
