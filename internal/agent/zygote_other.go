//go:build !linux

package agent

import (
	"os"
	"syscall"
	"time"
)

// waitExit polls for the process's end where there are no pidfds.
func waitExit(pid int) {
	p, err := os.FindProcess(pid)
	if err != nil {
		return
	}
	for p.Signal(syscall.Signal(0)) == nil {
		time.Sleep(100 * time.Millisecond)
	}
}
