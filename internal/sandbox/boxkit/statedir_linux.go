package boxkit

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// StateDir is the directory a backend keeps its per-box state under when
// its options name none, created with mode and checked to be this user's
// own. Root's is os.TempDir()/name, shared by every root kiln on the host
// (their orphan sweeps find each other's dead); another user's is
// os.TempDir()/name-<uid>, so a user's kiln never shares, or fails on, the
// directory a root kiln (or another user's) made. It stays under
// os.TempDir(), not $XDG_RUNTIME_DIR, because box uids that are not the
// user's must traverse it, and a runtime directory is mode 0700.
func StateDir(name string, mode os.FileMode) (string, error) {
	dir := filepath.Join(os.TempDir(), name)
	if uid := os.Getuid(); uid != 0 {
		dir += "-" + strconv.Itoa(uid)
	}
	return dir, OwnDir(dir, mode)
}

// OwnDir creates dir with mode if it is missing, and checks that it is a
// directory (not a symbolic link) that this user owns: in a directory all
// users can write to, such as /tmp, anyone may have made it first. Its
// mode is then set to mode.
func OwnDir(dir string, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return fmt.Errorf("creating state dir: %w", err)
	}
	if err := os.Mkdir(dir, mode); err != nil && !os.IsExist(err) {
		return fmt.Errorf("creating state dir: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("creating state dir: %w", err)
	}
	if !fi.IsDir() || !ownedBy(fi, os.Getuid()) {
		owner := -1
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			owner = int(st.Uid)
		}
		return fmt.Errorf("state dir %s is not a directory of yours (it is a %s owned by uid %d): remove it, or name another", dir, fi.Mode().Type(), owner)
	}
	if err := os.Chmod(dir, mode); err != nil {
		return fmt.Errorf("creating state dir: %w", err)
	}
	return nil
}

func ownedBy(fi os.FileInfo, uid int) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Uid) == uid
}
