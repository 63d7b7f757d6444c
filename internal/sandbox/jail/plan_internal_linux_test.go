package jail

import (
	"testing"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
)

// TestPlanRlimitsKnown: every rlimit of the box plan has a resource
// number in boxpolicy's table, which both the init (setRlimits) and the zygote's plan
// (zygoteRlimits) look up; an unknown name would be resource 0, CPU time.
func TestPlanRlimitsKnown(t *testing.T) {
	for _, r := range boxPlan(sandbox.DefaultLimits, boxUID, nil).Rlimits {
		if _, ok := boxpolicy.RlimitResource(r.Name); !ok {
			t.Errorf("no resource number for %s", r.Name)
		}
	}
}
