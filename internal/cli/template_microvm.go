package cli

import (
	"errors"
	"slices"
)

// servedFrom lists, for a backend that serves templates it cannot make,
// the backends whose templates it serves: the microVM packs a template's
// files (plain files) into a read-only disk, so it serves templates made
// on the jail; their --import modules are imported in the guest before
// the VM is saved.
var servedFrom = map[string][]string{"microvm": {"jail"}}

// checkServeBackend refuses a backend that cannot serve templates.
func checkServeBackend(backend string) error {
	if _, ok := servedFrom[backend]; ok {
		return nil
	}
	return checkTemplateBackend(backend)
}

// checkCreateBackend refuses a backend that cannot make templates, saying
// where to make one for it.
func checkCreateBackend(backend string) error {
	for b, made := range servedFrom {
		if b == backend && slices.Contains(made, "jail") {
			return errors.New("templates are made on the jail for the " + backend + " backend (kiln template create --backend jail): a " + backend + " server serves them")
		}
	}
	return checkTemplateBackend(backend)
}
