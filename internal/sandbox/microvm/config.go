package microvm

import (
	"flag"
	"time"
)

// Config is the microVM backend's part of kiln's command line: the flags
// only this backend reads. RegisterFlags gives them their defaults.
type Config struct {
	Accel             string
	TemplateMaxClones int           // 0: no bound
	TemplateMaxAge    time.Duration // 0: no bound
}

// RegisterFlags defines the microVM backend's flags on fs, storing their
// values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Accel, "accel", AccelKVM, "microvm: kvm, or tcg (software emulation: for development only, not a security boundary)")
	fs.IntVar(&c.TemplateMaxClones, "microvm-template-max-clones", DefaultTemplateMaxClones, "microvm: clones one template VM serves before a fresh one, booted in the background, replaces it (its clones share its memory layout and python's hash seed); 0: no bound")
	fs.DurationVar(&c.TemplateMaxAge, "microvm-template-max-age", DefaultTemplateMaxAge, "microvm: how long one template VM serves clones before a fresh one replaces it; 0: no bound")
}

// Apply sets the fields of o that c configures, turning the flags' "0: no
// bound" into the Options' (negative).
func (c Config) Apply(o Options) Options {
	o.Accel, o.TemplateMaxClones, o.TemplateMaxAge = c.Accel, c.TemplateMaxClones, c.TemplateMaxAge
	if c.TemplateMaxClones <= 0 {
		o.TemplateMaxClones = -1
	}
	if c.TemplateMaxAge <= 0 {
		o.TemplateMaxAge = -1
	}
	return o
}

// FirecrackerConfig is the Firecracker backend's part of kiln's command
// line.
type FirecrackerConfig struct {
	Bin    string
	Kernel string
}

// RegisterFlags defines the Firecracker backend's flags on fs, storing
// their values in c.
func (c *FirecrackerConfig) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Bin, "firecracker-bin", "firecracker", "firecracker: the firecracker binary (a name is looked up on $PATH)")
	fs.StringVar(&c.Kernel, "firecracker-kernel", "", "firecracker: the guest's vmlinux (default: the one kiln image build --firecracker-kernel built last)")
}

// Apply sets the fields of o that c configures.
func (c FirecrackerConfig) Apply(o FirecrackerOptions) FirecrackerOptions {
	o.Firecracker, o.Kernel = c.Bin, c.Kernel
	return o
}
