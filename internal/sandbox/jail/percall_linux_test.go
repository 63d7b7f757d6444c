package jail_test

import (
	"os"
	"testing"

	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session/sessiontest"
)

// perCallBackend is the jail, with boxes forked from a zygote or not.
func perCallBackend(t *testing.T, zygote bool) *jail.Backend {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("the jail tests need root (user namespaces with a uid range, cgroups)")
	}
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Zygote: zygote})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

func TestPerCallIsolation(t *testing.T) {
	sessiontest.RunPerCall(t, perCallBackend(t, false), sandboxtest.Options{HostProcesses: true})
}

func TestPerCallIsolationZygote(t *testing.T) {
	sessiontest.RunPerCall(t, perCallBackend(t, true), sandboxtest.Options{HostProcesses: true})
}
