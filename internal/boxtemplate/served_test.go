package boxtemplate_test

import (
	"errors"
	"strings"
	"testing"

	"kiln/internal/boxtemplate"
)

// TestLoadServed: a microVM server serves a template made on the jail
// and on the microVM, and refuses one made on gVisor or by another kiln.
func TestLoadServed(t *testing.T) {
	s := store(t)
	for name, backend := range map[string]string{"j": "jail", "g": "gvisor"} {
		st, err := s.Stage(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Commit(boxtemplate.Manifest{KilnVersion: "v1", Backend: backend, Setup: "setup.sh"}); err != nil {
			t.Fatal(err)
		}
	}
	if tpl, err := s.LoadServed("j", "v1", "microvm", []string{"jail"}); err != nil || tpl.Backend != "jail" {
		t.Errorf("jail template on microvm: %v", err)
	}
	if _, err := s.LoadServed("g", "v1", "microvm", []string{"jail"}); !errors.Is(err, boxtemplate.ErrMismatch) || !strings.Contains(err.Error(), "made for the gvisor backend, this server uses microvm") {
		t.Errorf("gvisor template on microvm: %v", err)
	}
	if _, err := s.LoadServed("j", "v2", "microvm", []string{"jail"}); !errors.Is(err, boxtemplate.ErrMismatch) || !strings.Contains(err.Error(), "made with kiln v1") {
		t.Errorf("another kiln's template on microvm: %v", err)
	}
	if _, err := s.LoadServed("j", "v1", "gvisor", nil); !errors.Is(err, boxtemplate.ErrMismatch) {
		t.Errorf("jail template on gvisor: %v", err)
	}
	if _, err := s.LoadServed("nope", "v1", "microvm", []string{"jail"}); !errors.Is(err, boxtemplate.ErrNotFound) {
		t.Errorf("unknown template: %v", err)
	}
}
