package main

import (
	"slices"
	"strings"
	"testing"
)

// TestSuitesFile: every suite fits on one tab-separated line of the
// guest's suites file, and expectedToFail names only suites that exist.
func TestSuitesFile(t *testing.T) {
	for _, s := range suites {
		for _, f := range []string{s.name, s.user, s.cmd} {
			if f == "" || strings.ContainsAny(f, "\t\n") {
				t.Errorf("suite %q: field %q is empty or has a tab or newline", s.name, f)
			}
		}
		if s.timeout <= 0 {
			t.Errorf("suite %q has no timeout", s.name)
		}
	}
	for name := range expectedToFail {
		if !slices.ContainsFunc(suites, func(s suite) bool { return s.name == name }) {
			t.Errorf("expectedToFail names %q, which is no suite", name)
		}
	}
}
