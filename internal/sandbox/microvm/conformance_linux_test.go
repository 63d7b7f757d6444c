package microvm_test

import (
	"testing"

	"kiln/internal/sandbox/microvm"
	"kiln/internal/sandbox/sandboxtest"
)

// TestConformance runs the sandbox suite against clones restored from a
// template, under TCG (timeouts scaled for emulation).
func TestConformance(t *testing.T) {
	b := newBackend(t, microvm.Options{})
	sandboxtest.RunWith(t, b, sandboxtest.Options{Scale: 10, OwnKernel: true})
}
