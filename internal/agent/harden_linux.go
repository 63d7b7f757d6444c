package agent

import (
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Harden protects the agent from the code it runs, which may share its box:
// the agent becomes non-dumpable (code of another uid can neither ptrace it
// nor open its /proc files; no core dump holds its memory), and every
// descriptor it inherited becomes close-on-exec, so nothing it starts gets
// one of its channels. Descriptors it opens itself are close-on-exec
// already (Go opens them so).
//
// With forCode, the agent is about to start code as another uid: it
// empties its inheritable capability set (through which a root exec gave
// it its capabilities), so that code inherits none, and drops its
// supplementary groups (a container runtime may give root some), which
// code would inherit. A user namespace that denies setgroups (the jail's)
// gave the agent none to drop.
func Harden(forCode bool) error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("setting non-dumpable: %w", err)
	}
	if forCode {
		if err := emptyInheritable(); err != nil {
			return err
		}
		if groups, _ := syscall.Getgroups(); len(groups) > 0 {
			if err := syscall.Setgroups(nil); err != nil && !errors.Is(err, syscall.EPERM) {
				return fmt.Errorf("dropping supplementary groups: %w", err)
			}
		}
	}
	if unix.CloseRange(0, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC) == nil {
		return nil
	}
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return fmt.Errorf("listing descriptors: %w", err)
	}
	for _, e := range entries {
		if fd, err := strconv.Atoi(e.Name()); err == nil {
			unix.CloseOnExec(fd)
		}
	}
	return nil
}

// emptyInheritable clears the inheritable set of every thread: capability
// sets are per thread, so the change goes through AllThreadsSyscall.
func emptyInheritable() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	if data[0].Inheritable == 0 && data[1].Inheritable == 0 {
		return nil
	}
	data[0].Inheritable, data[1].Inheritable = 0, 0
	if _, _, e := syscall.AllThreadsSyscall(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); e != 0 {
		if e == syscall.ENOTSUP {
			// What AllThreadsSyscall answers in a binary linked with cgo.
			return fmt.Errorf("capset: %w: this kiln-agent was built with cgo, which cannot change every thread's capabilities; build it static (CGO_ENABLED=0 go build ./cmd/kiln-agent, or make build)", e)
		}
		return fmt.Errorf("capset: %w", e)
	}
	return nil
}
