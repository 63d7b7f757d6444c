package jail_test

import (
	"flag"
	"testing"

	"kiln/internal/sandbox/jail"
)

// TestConfigFlags: the flags' defaults bound templates, and 0 means no
// bound (the jail's negative), never the jail's default.
func TestConfigFlags(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var c jail.Config
	c.RegisterFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	o := c.Apply(jail.Options{})
	if !o.Zygote || o.ZygoteMaxBoxes != jail.DefaultZygoteMaxBoxes || o.ZygoteMaxAge != jail.DefaultZygoteMaxAge {
		t.Errorf("defaults: %+v", o)
	}
	if err := fs.Parse([]string{"--zygote=false", "--zygote-max-boxes", "0", "--zygote-max-age", "0"}); err != nil {
		t.Fatal(err)
	}
	if o := c.Apply(jail.Options{}); o.Zygote || o.ZygoteMaxBoxes >= 0 || o.ZygoteMaxAge >= 0 {
		t.Errorf("--zygote=false and 0 (no bound): %+v", o)
	}
}
