//go:build !linux

package guestinit

// Setup is only supported on Linux guests.
func Setup() (stream string, err error) { return "", ErrUnsupported }

// PlanDigest is not supported on this OS.
func PlanDigest() (string, error) { return "", ErrUnsupported }

// PowerOff is only supported on Linux guests.
func PowerOff() error { return ErrUnsupported }
