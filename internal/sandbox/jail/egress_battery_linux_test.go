package jail_test

import (
	"testing"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// TestEgressBattery is the egress battery every networked backend runs.
func TestEgressBattery(t *testing.T) {
	newBackend(t) // skips without root
	sandboxtest.Egress(t, func(t *testing.T, gw *egress.Gateway, policy egress.Policy) sandbox.Backend {
		b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Egress: gw, Policy: policy})
		if err != nil {
			t.Fatal(err)
		}
		return b
	})
}
