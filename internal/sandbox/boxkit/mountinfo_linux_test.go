package boxkit

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMountsUnder mounts two tmpfs, one inside the other, under a
// directory whose name holds a space: both are found, deepest first, by
// their real paths.
func TestMountsUnder(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("mounting needs root")
	}
	dir := filepath.Join(t.TempDir(), "a dir")
	outer := filepath.Join(dir, "m 1")
	inner := filepath.Join(outer, "m\t2")
	if err := os.MkdirAll(outer, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, mp := range []string{outer, inner} {
		if err := os.MkdirAll(mp, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("tmpfs", mp, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { unix.Unmount(outer, unix.MNT_DETACH) })
	got, err := MountsUnder(dir)
	if want := []string{inner, outer}; err != nil || !slices.Equal(got, want) {
		t.Errorf("MountsUnder(%q) = %q, %v; want %q", dir, got, err, want)
	}
	if got, err := MountsUnder(dir + "x"); err != nil || len(got) > 0 {
		t.Errorf("MountsUnder of a sibling = %q, %v; want none", got, err)
	}
}
