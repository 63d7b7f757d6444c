package agent

import (
	"errors"
	"runtime"

	"golang.org/x/sys/unix"
)

// errNoFileIDs: the kernel does not let a thread change its file ids
// (gVisor ignores setfsuid).
var errNoFileIDs = errors.New("cannot act as another user on files")

// asUser runs f on a thread of its own whose filesystem uid and gid are
// uid and gid: every file f touches is checked, created and owned as if
// that user did it. setfsuid and setfsgid change only the calling thread;
// the thread is locked for f and then discarded with whatever ids it has,
// so no other goroutine ever runs with them.
func asUser(uid, gid int, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		unix.RawSyscall(unix.SYS_SETFSGID, uintptr(gid), 0, 0)
		unix.RawSyscall(unix.SYS_SETFSUID, uintptr(uid), 0, 0)
		// Called with an invalid id, both return the current one.
		g, _, _ := unix.RawSyscall(unix.SYS_SETFSGID, uintptr(^uint32(0)), 0, 0)
		u, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, uintptr(^uint32(0)), 0, 0)
		if int(u) != uid || int(g) != gid {
			errc <- errNoFileIDs
			return
		}
		errc <- f()
	}()
	return <-errc
}
