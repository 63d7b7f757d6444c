package agent

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// siginfo is the kernel's siginfo_t for SIGCHLD, as waitid(2) fills it:
// the child's pid follows the signal number, errno and code.
type siginfo struct {
	signo, errno, code int32
	_                  int32
	pid                int32
	uid                uint32
	status             int32
	_                  [100]byte
}

// peekDead fills info with a dead child's pid, leaving it unreaped, or 0
// when none has died (waitid P_ALL, WNOHANG|WNOWAIT).
func peekDead(info *siginfo) error {
	*info = siginfo{}
	_, _, e := unix.Syscall6(unix.SYS_WAITID, unix.P_ALL, 0, uintptr(unsafe.Pointer(info)), unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}
