package jail_test

import "kiln/internal/sandbox/jail"

func rootlessPremise() error { return jail.RootlessPremise() }

func cgroupError(b *jail.Backend) error { return jail.CgroupError(b) }
