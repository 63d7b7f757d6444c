package agent

import (
	"errors"

	"golang.org/x/sys/unix"
)

// waitExit returns when process pid, which need not be a child, has
// exited (a pidfd becomes readable), or at once if it cannot be watched.
func waitExit(pid int) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return
	}
	defer unix.Close(fd)
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		_, err := unix.Poll(fds, -1)
		if !errors.Is(err, unix.EINTR) {
			return
		}
	}
}
