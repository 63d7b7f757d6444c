package sandboxtest

import "golang.org/x/sys/unix"

// syscallNumbers are the numbers of the syscall probes on this
// architecture.
var syscallNumbers = map[string]int{
	"getpid":     unix.SYS_GETPID,
	"kcmp":       unix.SYS_KCMP,
	"clone3":     unix.SYS_CLONE3,
	"io_destroy": unix.SYS_IO_DESTROY,
}
