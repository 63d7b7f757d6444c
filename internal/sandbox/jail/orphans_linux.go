package jail

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// A box's mount point in the state directory is named
// "root-<server pid>-<random>", so a restarted server can tell the mount
// points of a dead predecessor (killed with -9, say) from those of another
// live server, as it does for cgroups.
func statePrefix(pid int) string { return "root-" + strconv.Itoa(pid) + "-" }

// removeOrphanedState removes the mount points that kiln servers no longer
// running left under the state directory, detaching any mount still there.
// Their cgroups go in cgroups.removeOrphans; the boxes' processes died with
// their server (Pdeathsig on each box's init, whose death ends its pid
// namespace).
func (b *Backend) removeOrphanedState() {
	n, err := removeOrphanedMountPoints(b.opts.StateDir)
	if n > 0 {
		b.log.Info("removed orphaned mount points of a previous kiln", "count", n)
	}
	if err != nil {
		b.log.Warn("removing orphaned mount points", "err", err)
	}
}

// removeOrphanedMountPoints removes dir's "root-<pid>-*" entries whose
// server pid is not running.
func removeOrphanedMountPoints(dir string) (removed int, err error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, fmt.Errorf("reading state dir: %w", err)
	}
	var errs []error
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), "root-")
		if !ok || !e.IsDir() {
			continue
		}
		owner, _, ok := strings.Cut(rest, "-")
		pid, perr := strconv.Atoi(owner)
		if !ok || perr != nil || pid <= 0 || processAlive(pid) {
			continue
		}
		p := filepath.Join(dir, e.Name())
		for _, m := range mountsUnder(p) {
			mp := strings.TrimPrefix(m, "mount ")
			if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
				errs = append(errs, fmt.Errorf("detaching %s: %w", mp, err))
			}
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("removing %s: %w", p, err))
			continue
		}
		removed++
	}
	return removed, errors.Join(errs...)
}
