package image

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox/boxkit"
)

// TestRemoveTreeLeftMounts: a build tree a killed build left with its
// chroot's /proc mounted, and a bind mount of files outside it, is removed
// whole, and the files outside are untouched. Plain os.RemoveAll, the
// control, fails on the proc (what a CI run met).
func TestRemoveTreeLeftMounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	leave := func(t *testing.T) (dir, outside string) {
		dir = filepath.Join(t.TempDir(), "base.tmp")
		proc := filepath.Join(dir, "rootfs", "proc")
		bind := filepath.Join(dir, "rootfs", "host")
		for _, d := range []string{proc, bind} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		outside = t.TempDir()
		if err := os.WriteFile(filepath.Join(outside, "precious"), []byte("keep"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("proc", proc, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			t.Skipf("mounting proc: %v", err)
		}
		if err := unix.Mount(outside, bind, "", unix.MS_BIND, ""); err != nil {
			unix.Unmount(proc, unix.MNT_DETACH)
			t.Skipf("bind mounting: %v", err)
		}
		t.Cleanup(func() {
			unix.Unmount(bind, unix.MNT_DETACH)
			unix.Unmount(proc, unix.MNT_DETACH)
		})
		return dir, outside
	}

	t.Run("control", func(t *testing.T) {
		dir, outside := leave(t)
		if err := os.RemoveAll(dir); err == nil {
			t.Fatal("os.RemoveAll removed a tree with a proc mounted in it; the premise of removeTree is gone")
		}
		if _, err := os.Stat(filepath.Join(outside, "precious")); err != nil {
			t.Logf("os.RemoveAll also deleted a file outside the tree, through the bind mount: %v", err)
		}
	})
	dir, outside := leave(t)
	if err := removeTree(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s is still there: %v", dir, err)
	}
	if m, _ := boxkit.MountsUnder(dir); len(m) > 0 {
		t.Errorf("still mounted: %v", m)
	}
	if b, err := os.ReadFile(filepath.Join(outside, "precious")); err != nil || string(b) != "keep" {
		t.Errorf("a file outside the tree, bind mounted into it: %q, %v", b, err)
	}
	if err := removeTree(dir); err != nil {
		t.Errorf("removing what is gone: %v", err)
	}
}
