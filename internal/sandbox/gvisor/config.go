package gvisor

import "flag"

// Config is the gVisor backend's part of kiln's command line: the flags
// only this backend reads.
type Config struct {
	Runsc string // "": the pinned build in kiln's cache
}

// RegisterFlags defines the gVisor backend's flags on fs, storing their
// values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Runsc, "runsc", "", "gvisor: a static runsc binary (default: the pinned build in kiln's cache)")
}
