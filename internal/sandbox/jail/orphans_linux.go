package jail

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox/boxkit"
)

// A box's mount point in the state directory is named
// "root-<owner>-<random>", and a zygote template's "zygote-<owner>-<random>",
// where owner is the server's stamp (pid and start time, boxkit.Owner), so a
// restarted server can tell the mount points of a dead predecessor (killed
// with -9, say) from those of another live server, as it does for cgroups.
func statePrefix() string  { return "root-" + boxkit.Self().String() + "-" }
func zygotePrefix() string { return "zygote-" + boxkit.Self().String() + "-" }

// removeOrphanedState removes the mount points that kiln servers no longer
// running left under the state directory, detaching any mount still there.
// Their cgroups go in cgroups.removeOrphans; the boxes' processes died with
// their server (Pdeathsig on each box's init, whose death ends its pid
// namespace); the templates' mounts lived in the dead templates'
// namespaces.
func (b *Backend) removeOrphanedState() {
	n, err := removeOrphanedMountPoints(b.opts.StateDir)
	if n > 0 {
		b.log.Info("removed orphaned mount points of a previous kiln", "count", n)
	}
	if err != nil {
		b.log.Warn("removing orphaned mount points", "err", err)
	}
}

// removeOrphanedMountPoints removes dir's box and template mount points
// whose server is not running.
func removeOrphanedMountPoints(dir string) (removed int, err error) {
	var errs []error
	for _, prefix := range []string{"root-", "zygote-"} {
		n, err := boxkit.SweepOrphans(dir, prefix, removeMountPoint)
		removed += n
		errs = append(errs, err)
	}
	return removed, errors.Join(errs...)
}

// removeMountPoint detaches whatever is mounted at or under p and removes p.
func removeMountPoint(p string) error {
	var errs []error
	for _, m := range mountsUnder(p) {
		mp := strings.TrimPrefix(m, "mount ")
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("detaching %s: %w", mp, err))
		}
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing %s: %w", p, err))
	}
	return errors.Join(errs...)
}
