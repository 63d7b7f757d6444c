package image

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox/boxkit"
)

// removeTree removes dir and everything under it, first detaching what is
// mounted at or below it. A build killed in a chroot step leaves that
// step's /proc mounted (debootstrap's own, or chrootOutput's) in a tree
// like this, and a removal must never walk into a mount: it fails on a
// proc, and on a bind mount it would delete the host's files.
func removeTree(dir string) error {
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real // mountinfo names resolved paths
	} else if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	mounts, err := boxkit.MountsUnder(dir)
	if err != nil {
		return err
	}
	for _, mp := range mounts {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("detaching %s, left mounted in %s: %w", mp, dir, err)
		}
	}
	return os.RemoveAll(dir)
}
