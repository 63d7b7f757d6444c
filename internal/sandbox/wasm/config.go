package wasm

import "flag"

// Config is the wasm backend's part of kiln's command line: the flags only
// this backend reads.
type Config struct {
	Dir     string // --wasm-dir
	Deno    string // --deno
	Pyodide string // --pyodide
	Wheels  string // --wasm-wheels
	Cold    bool   // --wasm-cold
}

// RegisterFlags defines the wasm backend's flags on fs, storing their
// values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Dir, "wasm-dir", "", "wasm: where `kiln wasm install` puts Deno and Pyodide (default: kiln's cache)")
	fs.StringVar(&c.Deno, "deno", "", "wasm: a deno binary instead of the pinned one")
	fs.StringVar(&c.Wheels, "wasm-wheels", "", "wasm: a directory of wheels (pure Python, or built for Pyodide) every box loads at start, offline")
	fs.BoolVar(&c.Cold, "wasm-cold", false, "wasm: load Pyodide from scratch in every box instead of restoring a memory snapshot")
	fs.StringVar(&c.Pyodide, "pyodide", "", "wasm: a Pyodide directory (holding pyodide.mjs) instead of the pinned one")
}

// Apply fills opts from the flags.
func (c *Config) Apply(opts Options) Options {
	opts.Dir, opts.Deno, opts.Pyodide, opts.Wheels, opts.Cold = c.Dir, c.Deno, c.Pyodide, c.Wheels, c.Cold
	return opts
}
