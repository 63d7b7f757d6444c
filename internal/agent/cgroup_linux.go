package agent

import "syscall"

// setCgroupFD starts the child directly in the cgroup (clone3's
// CLONE_INTO_CGROUP), so no instant of it runs outside the limits.
func setCgroupFD(attr *syscall.SysProcAttr, fd int) {
	attr.UseCgroupFD = true
	attr.CgroupFD = fd
}
