package main

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
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

// TestWatchdog: the guest counts as hung when its runner goes silent, or
// when a suite outlives its timeout and the kill's grace; a suite that
// ends in time, heartbeats and all, never does.
func TestWatchdog(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	picked := []suite{{name: "a", timeout: 6 * time.Minute}, {name: "b", timeout: time.Minute}}

	d := newWatchdog(picked)
	if why := d.verdict(t0.Add(time.Hour)); why != "" {
		t.Errorf("before the runner spoke (booting): %q", why)
	}
	d.heard("kernel: 6.1.0", t0)
	d.heard("suite a (as root): started", t0)
	for m := 1; m <= 6; m++ {
		now := t0.Add(time.Duration(m) * time.Minute)
		d.heard(fmt.Sprintf("suite a: running for %d s, last: === RUN TestX", m*60), now)
		if why := d.verdict(now.Add(30 * time.Second)); why != "" {
			t.Fatalf("a suite within its timeout, heartbeating, at %d min: %q", m, why)
		}
	}
	end := t0.Add(6*time.Minute + 20*time.Second)
	d.heard("suite a: exit 0 after 380 s", end)
	d.heard("suite b (as kiln): started", end)
	if why := d.verdict(end.Add(4 * time.Minute)); why != "" {
		t.Errorf("suite b, silent 4 min (under %s) and within its timeout and grace: %q", silence, why)
	}
	if why := d.verdict(end.Add(4*time.Minute + 10*time.Second)); !strings.Contains(why, "suite b ran") {
		t.Errorf("suite b past its timeout of 1 min and the grace of %s: verdict %q", grace, why)
	}

	d = newWatchdog(picked)
	d.heard("suite a (as root): started", t0)
	if why := d.verdict(t0.Add(silence + time.Second)); !strings.Contains(why, "said nothing") {
		t.Errorf("a runner silent for more than %s: verdict %q", silence, why)
	}
}
