package jail

import (
	"flag"
	"time"
)

// Config is the jail's part of kiln's command line: the flags only this
// backend reads. RegisterFlags gives them their defaults.
type Config struct {
	Zygote         bool
	ZygoteMaxBoxes int           // 0: no bound
	ZygoteMaxAge   time.Duration // 0: no bound
}

// RegisterFlags defines the jail's flags on fs, storing their values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.BoolVar(&c.Zygote, "zygote", true, "jail: fork boxes from a template python with the preloaded modules imported (falls back to starting python per box where it cannot run)")
	fs.IntVar(&c.ZygoteMaxBoxes, "zygote-max-boxes", DefaultZygoteMaxBoxes, "jail: boxes one zygote template makes before a fresh one, started in the background, replaces it (its boxes share its addresses and secrets); 0: no bound")
	fs.DurationVar(&c.ZygoteMaxAge, "zygote-max-age", DefaultZygoteMaxAge, "jail: how long one zygote template makes boxes before a fresh one replaces it; 0: no bound")
}

// Apply sets the fields of o that c configures, turning the flags' "0: no
// bound" into the Options' (negative).
func (c Config) Apply(o Options) Options {
	o.Zygote, o.ZygoteMaxBoxes, o.ZygoteMaxAge = c.Zygote, c.ZygoteMaxBoxes, c.ZygoteMaxAge
	if c.ZygoteMaxBoxes <= 0 {
		o.ZygoteMaxBoxes = -1
	}
	if c.ZygoteMaxAge <= 0 {
		o.ZygoteMaxAge = -1
	}
	return o
}
