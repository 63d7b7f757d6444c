//go:build !linux

package agent

import "syscall"

func setCgroupFD(attr *syscall.SysProcAttr, fd int) {}
