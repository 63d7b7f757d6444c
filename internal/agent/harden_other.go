//go:build !linux

package agent

// Harden is a no-op where the agent never shares a box with code.
func Harden(forCode bool) error { return nil }
