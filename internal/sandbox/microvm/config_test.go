package microvm_test

import (
	"flag"
	"testing"

	"kiln/internal/sandbox/microvm"
)

// TestConfigFlags: the flags' defaults are KVM and the template bounds,
// and 0 means no bound (the backend's negative), never its default.
func TestConfigFlags(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var c microvm.Config
	c.RegisterFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	o := c.Apply(microvm.Options{})
	if o.Accel != microvm.AccelKVM || o.TemplateMaxClones != microvm.DefaultTemplateMaxClones || o.TemplateMaxAge != microvm.DefaultTemplateMaxAge {
		t.Errorf("defaults: %+v", o)
	}
	if err := fs.Parse([]string{"--accel", "tcg", "--microvm-template-max-clones", "0", "--microvm-template-max-age", "0"}); err != nil {
		t.Fatal(err)
	}
	if o := c.Apply(microvm.Options{}); o.Accel != microvm.AccelTCG || o.TemplateMaxClones >= 0 || o.TemplateMaxAge >= 0 {
		t.Errorf("--accel tcg and 0 (no bound): %+v", o)
	}
}
