package session

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// stateLockName is the lock file in a state directory's root.
const stateLockName = ".lock"

// A StateLock holds a state directory for one server. Two servers on one
// directory would each wake and save the same sessions, diverging, and
// each would count the directory's quotas alone. The lock is a flock, so
// it goes with the server's process however that ends; on NFS it is the
// server's lock manager's.
type StateLock struct{ f *os.File }

// LockStateDir takes dir (PrepareStateDir's) for this server. While
// another server holds it (one stopping may still be saving its
// sessions), it waits up to wait, then fails naming the holder.
func LockStateDir(ctx context.Context, dir string, wait time.Duration, log *slog.Logger) (*StateLock, error) {
	f, err := os.OpenFile(filepath.Join(dir, stateLockName), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("locking state directory %s: %w", dir, err)
	}
	deadline := time.Now().Add(wait)
	waited := false
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if errors.Is(err, unix.ENOLCK) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) {
			f.Close()
			return nil, fmt.Errorf("locking state directory %s: its file system takes no locks (%w), so kiln cannot make sure it is the only server there; use a local directory, or NFS with its lock service", dir, err)
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("locking state directory %s: %w", dir, err)
		}
		holder := lockHolder(f)
		if !time.Now().Before(deadline) {
			f.Close()
			return nil, fmt.Errorf("state directory %s is in use by another kiln (%s): two servers on one state directory would wake and save the same sessions; give each server its own --state-dir, or stop the other one first", dir, holder)
		}
		if !waited {
			log.Warn("waiting for another kiln to let go of the state directory (one stopping may still be saving its sessions)", "dir", dir, "holder", holder, "wait", wait)
			waited = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("locking state directory %s: %w", dir, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	host, _ := os.Hostname()
	if err := f.Truncate(0); err == nil {
		f.WriteAt(fmt.Appendf(nil, "pid %d on %s\n", os.Getpid(), host), 0)
	}
	return &StateLock{f: f}, nil
}

// lockHolder is what the holder of a state lock wrote of itself.
func lockHolder(f *os.File) string {
	b, _ := io.ReadAll(io.NewSectionReader(f, 0, 256))
	if s := strings.TrimSpace(string(b)); s != "" && !strings.ContainsFunc(s, func(r rune) bool { return r < ' ' || r == 0x7f }) {
		return s
	}
	return "it did not say which"
}

// Close lets the directory go.
func (l *StateLock) Close() error {
	if l == nil {
		return nil
	}
	return l.f.Close()
}
