//go:build unix

package session

import (
	"fmt"
	"os"
	"syscall"
)

// ownedByUs refuses a state directory that belongs to another user: they
// could read what kiln saves there, or plant sessions for it to restore.
func ownedByUs(path string, fi os.FileInfo) error {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	if uid := int(st.Uid); uid != os.Geteuid() {
		return fmt.Errorf("state directory %s belongs to uid %d, not to the user running kiln (uid %d)", path, uid, os.Geteuid())
	}
	return nil
}
