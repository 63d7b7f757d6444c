package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestImportsStayInsideTheBox enforces that kiln-agent, which runs inside
// every box, is built from the standard library, golang.org/x/sys and the
// in-box packages only: never from host-side code.
func TestImportsStayInsideTheBox(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Skipf("go list: %v", err)
	}
	inBox := map[string]bool{
		"kiln/cmd/kiln-agent":      true,
		"kiln/internal/agent":      true,
		"kiln/internal/agentproto": true,
		"kiln/internal/kernel":     true,
		"kiln/internal/guestinit":  true,
		// Data only, standard library only: the box policy the backends and
		// the agent share.
		"kiln/internal/boxpolicy": true,
	}
	for _, pkg := range strings.Fields(string(out)) {
		first, _, _ := strings.Cut(pkg, "/")
		switch {
		case inBox[pkg]:
		case strings.HasPrefix(pkg, "golang.org/x/sys/"):
		case !strings.Contains(first, ".") && first != "kiln":
			// the standard library
		default:
			t.Errorf("kiln-agent depends on %s, which is not in-box code", pkg)
		}
	}
}
