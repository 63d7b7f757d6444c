package boxkit

import (
	"os"
	"testing"
)

// TestConfinedSees: a program under the host's runtime directories is in
// a confined root; one elsewhere, or a directory's mere prefix, is not.
func TestConfinedSees(t *testing.T) {
	if fi, err := os.Lstat("/usr"); err != nil || !fi.IsDir() {
		t.Skip("this host has no /usr directory")
	}
	for p, want := range map[string]bool{
		"/usr/bin/qemu-system-x86_64": true,
		"/usr":                        false,
		"/usrlocal/bin/qemu":          false,
		"/opt/qemu/bin/qemu":          false,
		"/tmp/qemu":                   false,
		"/home/u/qemu":                false,
	} {
		if got := ConfinedSees(p); got != want {
			t.Errorf("ConfinedSees(%q) = %v, want %v", p, got, want)
		}
	}
}
