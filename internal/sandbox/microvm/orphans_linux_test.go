package microvm

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"kiln/internal/sandbox/boxkit"
)

// TestRemoveOrphanedRunDirs: a new backend's sweep removes the run
// directory of a server that is gone and keeps that of one that runs.
func TestRemoveOrphanedRunDirs(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	dead := filepath.Join(tmp, "kiln-microvm-"+boxkit.Owner{PID: gone.Process.Pid, Start: 1}.String())
	live := filepath.Join(tmp, "kiln-microvm-"+boxkit.Self().String())
	for _, d := range []string{dead, live} {
		if err := os.MkdirAll(filepath.Join(d, "vm"), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	removeOrphans("kiln-microvm-test-none")
	if _, err := os.Stat(dead); err == nil {
		t.Errorf("the run directory of a dead server survives")
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("the run directory of a live server went: %v", err)
	}
}
