package cli

import (
	"flag"
	"strings"
	"testing"

	"kiln/internal/bench"
)

func TestMicrovmAccel(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "kvm"},
		{[]string{"--pool", "1", "--accel", "tcg"}, "tcg"},
		{[]string{"-accel=tcg"}, "tcg"},
	} {
		if got := entry("microvm").bench.Accel(c.args); got != c.want {
			t.Errorf("microvm accel of %q = %q, want %q", c.args, got, c.want)
		}
	}
	if entry("jail").bench.Accel != nil {
		t.Error("the jail names an accelerator")
	}
}

// TestBenchDefaults: kiln bench's flags show bench.Default, the values a
// zero Options takes, stated once.
func TestBenchDefaults(t *testing.T) {
	var help strings.Builder
	if err := runBench([]string{"-h"}, &help, &help); err != flag.ErrHelp {
		t.Fatalf("kiln bench -h: %v", err)
	}
	d := bench.Default
	for _, want := range []string{
		`-backend string` + "\n" + `    	backend of the kiln servers under test: jail, gvisor, microvm, firecracker, wasm, cluster or kubernetes (default "` + d.Backend + `")`,
		`(default "` + d.Python + `")`, `(default "1,2,8")`, `(default ` + d.Duration.String() + `)`, `(default ` + d.Gap.String() + `)`,
	} {
		if !strings.Contains(help.String(), want) {
			t.Errorf("kiln bench -h lacks %q:\n%s", want, help.String())
		}
	}
}

// TestBenchTraitsFromRegistry: the bench knows a backend by its registry
// entry: the jail's boxes have cgroups and hardening rows, kubernetes is a
// cluster (in a build that has it).
func TestBenchTraitsFromRegistry(t *testing.T) {
	if j := entry("jail").bench; !j.BoxCgroups || !j.Hardening || j.Cluster {
		t.Errorf("jail's bench traits %+v", j)
	}
	if k := entry("kubernetes"); k.absent == nil && !k.bench.Cluster {
		t.Errorf("kubernetes is not a cluster to the bench: %+v", k.bench)
	}
	if err := runBench([]string{"--backend", "nosuch"}, new(strings.Builder), new(strings.Builder)); err == nil || !strings.Contains(err.Error(), "unknown backend") {
		t.Errorf("kiln bench --backend nosuch: %v", err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--backend", "jail", "--alongside", "gvisor"}, "only a cluster run"},
		{[]string{"--backend", "cluster", "--alongside", "nosuch"}, "unknown backend"},
		{[]string{"--backend", "cluster", "--alongside", "jail"}, "measured already"},
	} {
		if err := runBench(c.args, new(strings.Builder), new(strings.Builder)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("kiln bench %s: %v, want an error saying %q", strings.Join(c.args, " "), err, c.want)
		}
	}
}
