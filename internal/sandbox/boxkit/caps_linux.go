package boxkit

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Capability sets, as the box inits that hold them (the jail's, the jailed
// QEMU's) shrink them. Raw prctl and capset calls: they act on the calling
// thread, which must be the locked one that execs.

// CapMask is the capability set holding caps.
func CapMask(caps []uintptr) uint64 {
	var m uint64
	for _, c := range caps {
		m |= 1 << c
	}
	return m
}

// DropBounding removes every capability not in keep from the bounding set
// (it needs CAP_SETPCAP, so it comes before the thread's own sets shrink)
// and clears the ambient set.
func DropBounding(keep uint64) error {
	for c := 0; c <= 63; c++ {
		if keep&(1<<c) != 0 {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("dropping capability %d: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clearing ambient capabilities: %w", err)
	}
	return nil
}

// SetCaps sets this thread's permitted and effective sets to keep, and its
// inheritable set to inheritable.
func SetCaps(keep, inheritable uint64) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: uint32(keep), Permitted: uint32(keep), Inheritable: uint32(inheritable)},
		{Effective: uint32(keep >> 32), Permitted: uint32(keep >> 32), Inheritable: uint32(inheritable >> 32)},
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}

// LimitCaps keeps only keep, as root, across the exec that follows: a root
// exec's permitted set is the inheritable set joined with the bounding
// set, which is emptied.
func LimitCaps(keep uint64) error {
	// The inheritable set may only grow within the bounding set: set it
	// first, while the bounding set is whole.
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[0].Inheritable, data[1].Inheritable = uint32(keep), uint32(keep>>32)
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	if err := DropBounding(0); err != nil {
		return err
	}
	return SetCaps(keep, keep)
}
