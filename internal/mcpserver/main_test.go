package mcpserver_test

import (
	"os"
	"testing"

	"kiln/internal/sandbox/jail"
)

// TestMain lets the test binary serve as a jail's init when re-executed.
func TestMain(m *testing.M) {
	jail.MaybeInit()
	os.Exit(m.Run())
}
