//go:build !linux

package guestinit

// Setup is only supported on Linux guests.
func Setup(cfg Config) (stream string, err error) { return "", ErrUnsupported }

// PowerOff is only supported on Linux guests.
func PowerOff() error { return ErrUnsupported }
