//go:build !linux

package jail_test

import (
	"errors"

	"kiln/internal/sandbox/jail"
)

func rootlessPremise() error { return errors.New("the jail runs on Linux only") }

func cgroupError(*jail.Backend) error { return errors.New("the jail runs on Linux only") }
