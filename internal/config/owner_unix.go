//go:build unix

package config

import (
	"fmt"
	"os"
	"syscall"
)

// checkOwner refuses a file that its group or others may write, or that
// belongs to a user other than root and the one running kiln.
func checkOwner(path string, fi os.FileInfo) error {
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		return fmt.Errorf("%w: %s is writable by its group or by others (mode %04o); chmod go-w %s", ErrUnsafeFile, path, perm, path)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	if uid := int(st.Uid); uid != 0 && uid != os.Geteuid() {
		return fmt.Errorf("%w: %s belongs to uid %d, not to root or to the user running kiln (uid %d)", ErrUnsafeFile, path, uid, os.Geteuid())
	}
	return nil
}
