package boxpolicy

import (
	"os/exec"
	"strings"
	"testing"
)

// TestStandardLibraryOnly keeps the box policy readable by everything that
// makes a box, inside it too (kiln-agent, the microVM guest's init): the
// package itself pulls in nothing beyond the standard library, for every
// operating system it builds for.
func TestStandardLibraryOnly(t *testing.T) {
	for _, goos := range []string{"linux", "darwin"} {
		cmd := exec.Command("go", "list", "-deps", ".")
		cmd.Env = append(cmd.Environ(), "GOOS="+goos)
		out, err := cmd.Output()
		if err != nil {
			t.Skipf("go list (GOOS=%s): %v", goos, err)
		}
		for _, pkg := range strings.Fields(string(out)) {
			first, _, _ := strings.Cut(pkg, "/")
			std := !strings.Contains(first, ".") && first != "kiln"
			if pkg != "kiln/internal/boxpolicy" && !std {
				t.Errorf("GOOS=%s: boxpolicy depends on %s", goos, pkg)
			}
		}
	}
}
