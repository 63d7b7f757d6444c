// Package guestinit prepares a microVM guest when kiln-agent runs as its
// PID 1: mounts, the workspace tmpfs, the host stream device. It runs inside
// the box and imports no host-side code.
package guestinit

import "errors"

// Config is what the agent passes to Setup.
type Config struct {
	Workspace string // where the size-capped workspace tmpfs goes, e.g. /work
}

// Setup prepares the guest and returns the path of the character device
// that carries the agent protocol to the host.
func Setup(cfg Config) (stream string, err error) {
	return "", errors.New("guestinit: not implemented yet")
}
