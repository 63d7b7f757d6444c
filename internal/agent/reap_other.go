//go:build !linux

package agent

import "errors"

type siginfo struct{ pid int32 }

// peekDead: boxes are Linux; elsewhere the agent reaps nothing.
func peekDead(*siginfo) error { return errors.ErrUnsupported }
