package kernel

import (
	"strings"
	"testing"
)

// TestZygoteReseedsFromPlan keeps the host's reseed list (sandbox.ReseedCode,
// carried in the zygote plan) the only one: the fork server runs the
// plan's and redraws no generator of its own.
func TestZygoteReseedsFromPlan(t *testing.T) {
	if !strings.Contains(Zygote, `exec(plan.get("reseed") or "", {})`) {
		t.Error("zygote.py does not run the plan's reseed code")
	}
	if strings.Contains(Zygote, ".seed(") {
		t.Error("zygote.py reseeds a generator itself: add it to sandbox.ReseedCode instead")
	}
}
