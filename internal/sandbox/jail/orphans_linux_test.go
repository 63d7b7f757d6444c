package jail

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox/boxkit"
)

// TestOrphanedMountPointWithSpace: a dead server's mount point under a
// state directory whose path holds a space (mountinfo spells it \040) is
// still found, detached and removed, and listed while it is there.
func TestOrphanedMountPointWithSpace(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("mounting needs root")
	}
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(t.TempDir(), "state dir")
	dead := boxkit.Owner{PID: gone.Process.Pid, Start: 1} // no process has it
	mp := filepath.Join(state, "root-"+dead.String()+"-x")
	if err := os.MkdirAll(mp, 0o711); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(mp, unix.MNT_DETACH) })
	if got := mountsUnder(state); len(got) != 1 || got[0] != "mount "+mp {
		t.Errorf("mountsUnder(%q) = %q; want [%q]", state, got, "mount "+mp)
	}
	n, err := removeOrphanedMountPoints(state)
	if n != 1 || err != nil {
		t.Errorf("removeOrphanedMountPoints = %d, %v; want 1, nil", n, err)
	}
	if _, err := os.Stat(mp); err == nil {
		t.Errorf("the orphaned mount point %s survives", mp)
	}
}
