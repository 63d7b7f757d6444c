//go:build unix

package config

import (
	"fmt"
	"os"
	"os/user"
	"strconv"
	"syscall"
)

// checkTrusted refuses a file that belongs to a user other than root and
// the one running kiln, that its group or others may write, or, for a
// secret, read. The error names the file, its owner and mode, and the
// command that fixes it.
func checkTrusted(what, path string, fi os.FileInfo, secret bool) error {
	perm := fi.Mode().Perm()
	uid := -1
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		uid = int(st.Uid)
	}
	if err := CheckOwner(what, path, fi); err != nil {
		return err
	}
	switch {
	case secret && perm&0o077 != 0:
		return fmt.Errorf("%w: the %s %s (owner %s, mode %04o) is open to its group or others; make it private to its owner: chmod 600 %s",
			ErrUnsafeFile, what, path, owner(uid), perm, path)
	case perm&0o022 != 0:
		return fmt.Errorf("%w: the %s %s (owner %s, mode %04o) is writable by its group or by others; chmod go-w %s",
			ErrUnsafeFile, what, path, owner(uid), perm, path)
	}
	return nil
}

// CheckOwner refuses a file, described by fi, that belongs to a user
// other than root and the one running kiln: its owner can change it
// whatever its mode. OpenTrusted checks this first; a file kiln writes
// and sets the mode of itself (the audit log) is checked with this alone.
func CheckOwner(what, path string, fi os.FileInfo) error {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	uid, me := int(st.Uid), os.Geteuid()
	if uid != 0 && uid != me {
		return fmt.Errorf("%w: the %s %s belongs to %s (mode %04o), not to root or to the user running kiln (%s); chown %d %s",
			ErrUnsafeFile, what, path, owner(uid), fi.Mode().Perm(), owner(me), me, path)
	}
	return nil
}

// owner names uid, with its user name where the host has one.
func owner(uid int) string {
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil {
		return fmt.Sprintf("uid %d (%s)", uid, u.Username)
	}
	return fmt.Sprintf("uid %d", uid)
}
