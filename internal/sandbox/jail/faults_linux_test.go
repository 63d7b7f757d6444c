package jail_test

import (
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

var _ sandboxtest.LeakChecker = (*jail.Backend)(nil)
