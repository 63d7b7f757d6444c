package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"kiln/internal/config"
)

// flagEnv is the environment variable that sets a flag unless the command
// line does, over the configuration file: KILN_ and the flag's name in
// capitals, dashes as underscores (--max-output: KILN_MAX_OUTPUT).
// KILN_CONFIG (the file itself) and KILN_TOKEN (one more bearer token, not
// a flag) are read where they are used.
func flagEnv(name string) string {
	return "KILN_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

const configUsage = "configuration file, TOML (default: $KILN_CONFIG, else the first of $XDG_CONFIG_HOME/kiln/kiln.toml and " + config.SystemPath + " that exists; \"\": none); see kiln config print"

// parseFlags parses a serving command's flags: its command line, then the
// environment and the configuration file where the command line did not
// set a flag (see package config). A command that reads kiln's
// configuration defines all its flags, then calls parseFlags in place of
// fs.Parse before doing anything else: kiln config print runs a command's
// function up to here to learn its flags and their values.
func parseFlags(fs *flag.FlagSet, args []string) error {
	_, _, err := resolveFlags(fs, args)
	return err
}

// c.parseFlags is parseFlags for a command that runs the one backend
// --backend names. A flag of another backend on its command line does
// nothing there: c.logger warns of it. (The file and the environment may
// hold every backend's settings; and kiln bench gives its servers, and
// the jail it measures alongside, the same flags.)
func (c *common) parseFlags(fs *flag.FlagSet, args []string) error {
	vals, layout, err := resolveFlags(fs, args)
	if err != nil {
		return err
	}
	own, known := map[string]bool{}, false
	for _, s := range layout.Sections {
		if s.Name == c.backend {
			known = true
			for _, f := range s.Flags {
				own[f] = true
			}
		}
	}
	if !known {
		return nil // the backend's factory says it is unknown
	}
	for _, s := range layout.Sections {
		for _, f := range s.Flags {
			if s.Name != c.backend && !own[f] && vals.Sources[f] == config.Flag {
				c.ignored = append(c.ignored, foreignFlag{flag: f, backend: s.Name})
			}
		}
	}
	return nil
}

// foreignFlag is a flag of another backend than the one a command runs.
type foreignFlag struct{ flag, backend string }

func resolveFlags(fs *flag.FlagSet, args []string) (*config.Values, config.Layout, error) {
	cfg := fs.String("config", "", configUsage)
	if err := fs.Parse(args); err != nil {
		return nil, config.Layout{}, hintMissingFlag(err)
	}
	capture, _ := fs.Output().(*flagCapture)
	if capture != nil && capture.flagsOnly {
		capture.fs = fs
		return nil, config.Layout{}, errCaptured
	}
	path, data, err := readConfigFile(fs, *cfg, os.LookupEnv)
	if err != nil {
		return nil, config.Layout{}, err
	}
	layout, err := fileLayout()
	if err != nil {
		return nil, config.Layout{}, err
	}
	vals, err := config.Resolve(fs, path, data, layout, os.LookupEnv)
	if err != nil {
		return nil, config.Layout{}, err
	}
	if capture != nil {
		capture.fs, capture.vals = fs, vals
		return nil, config.Layout{}, errCaptured
	}
	return vals, layout, nil
}

// readConfigFile finds and reads the configuration file: --config, else
// KILN_CONFIG, else the user's or the system's file if one exists. A file
// named by --config or KILN_CONFIG must exist; an empty name reads none.
func readConfigFile(fs *flag.FlagSet, flagPath string, getenv func(string) (string, bool)) (string, []byte, error) {
	path, named := flagPath, false
	fs.Visit(func(f *flag.Flag) { named = named || f.Name == "config" })
	if !named {
		path, named = getenv("KILN_CONFIG")
	}
	if !named {
		path = config.Find(getenv)
	}
	if path == "" {
		return "", nil, nil
	}
	data, err := config.ReadFile(path)
	return path, data, err
}

// fileLayout is what the configuration file may hold: every flag of kiln
// serve (which defines every serving flag), each backend's own flags in
// its [backends.<name>] table.
func fileLayout() (config.Layout, error) {
	known, err := serveFlags()
	if err != nil {
		return config.Layout{}, err
	}
	env := map[string]string{}
	known.VisitAll(func(f *flag.Flag) {
		if f.Name != "config" {
			env[f.Name] = flagEnv(f.Name)
		}
	})
	l := config.Layout{Known: known, Env: env, NotInFile: []string{"config"}}
	for _, e := range registry {
		s := config.Section{Group: "backends", Name: e.name, Absent: e.absent}
		if e.absent != nil {
			l.Sections = append(l.Sections, s)
			continue
		}
		fs := flag.NewFlagSet(e.name, flag.ContinueOnError)
		e.flags(fs)
		fs.VisitAll(func(f *flag.Flag) { s.Flags = append(s.Flags, f.Name) })
		l.Sections = append(l.Sections, s)
	}
	return l, nil
}

// serveFlags returns a fresh flag set with kiln serve's flags, at their
// defaults.
func serveFlags() (*flag.FlagSet, error) {
	c := &flagCapture{flagsOnly: true, w: io.Discard}
	if err := runServe(nil, c); !errors.Is(err, errCaptured) || c.fs == nil {
		return nil, fmt.Errorf("learning kiln serve's flags: it did not stop in parseFlags (%v)", err)
	}
	return c.fs, nil
}

// errCaptured stops a command once parseFlags has captured its flags.
var errCaptured = errors.New("flags captured")

// flagCapture is given to a command as its stderr, which the command makes
// its flag set's output: parseFlags finds it there, records the flag set
// (and with flagsOnly unset, the values resolved) and stops the command.
type flagCapture struct {
	w         io.Writer
	flagsOnly bool
	fs        *flag.FlagSet
	vals      *config.Values
}

func (c *flagCapture) Write(p []byte) (int, error) { return c.w.Write(p) }

// configCommands are the commands whose configuration kiln config print
// shows.
var configCommands = map[string]func(args []string, stderr io.Writer) error{
	"serve": func(args []string, stderr io.Writer) error { return runServe(args, stderr) },
	"mcp":   func(args []string, stderr io.Writer) error { return runMCP(args, io.Discard, stderr) },
	"run": func(args []string, stderr io.Writer) error {
		_, err := runOnce(args, io.Discard, stderr)
		return err
	},
	"doctor": func(args []string, stderr io.Writer) error { return runDoctor(args, io.Discard, stderr) },
}

const configHelp = `Usage:
  kiln config print [serve|mcp|run|doctor] [flags]

Prints the effective configuration of the command (default: serve) as a
TOML configuration file: every setting with its help, where it came from
(flag, env, file), and the defaults commented out. The flags are the
command's own (kiln serve -h), --config among them. With nothing set, the
output is kiln.example.toml.
`

// configHead starts what kiln config print writes; with nothing set, the
// output is kiln.example.toml.
const configHead = `kiln configuration file (TOML), written by kiln config print.

Each key is a flag of kiln serve (kiln serve -h); kiln mcp, kiln run and
kiln doctor read the same file and skip the keys they have no flag for.
A backend's own settings go in its table, [backends.<name>].
Precedence: command line > environment > this file > default; the
variable of a key is KILN_ and its name in capitals, dashes as
underscores (max-output: KILN_MAX_OUTPUT).
A commented-out key shows its default; a set key names its source.
kiln reads --config FILE, else $KILN_CONFIG, else the first of
$XDG_CONFIG_HOME/kiln/kiln.toml (~/.config/kiln/kiln.toml) and
/etc/kiln/kiln.toml that exists. No one but its owner (root or the user
running kiln) may be able to write it.`

func runConfig(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "print" {
		fmt.Fprint(stderr, configHelp)
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
			return flag.ErrHelp
		}
		return errors.New("usage: kiln config print [serve|mcp|run|doctor] [flags]")
	}
	args = args[1:]
	cmd := "serve"
	if len(args) > 0 {
		if _, ok := configCommands[args[0]]; ok {
			cmd, args = args[0], args[1:]
		}
	}
	c := &flagCapture{w: stderr}
	if err := configCommands[cmd](args, c); !errors.Is(err, errCaptured) {
		if err == nil {
			err = fmt.Errorf("kiln %s did not call parseFlags first", cmd)
		}
		return err
	}
	return printConfig(stdout, cmd, c.fs, c.vals)
}

func printConfig(w io.Writer, cmd string, fs *flag.FlagSet, vals *config.Values) error {
	head := configHead
	if cmd != "serve" {
		head += "\n\nThe configuration of kiln " + cmd + "."
	}
	if vals.Path != "" {
		head += "\n\nRead from " + vals.Path + "."
	}
	var envs []string
	for name, env := range vals.EnvVars {
		envs = append(envs, env+" (--"+name+")")
	}
	sort.Strings(envs)
	if _, ok := os.LookupEnv("KILN_TOKEN"); ok && cmd == "serve" {
		envs = append(envs, "KILN_TOKEN (one more bearer token; not shown)")
	}
	if len(envs) > 0 {
		head += "\n\nFrom the environment:"
		for _, e := range envs {
			head += "\n  " + e
		}
	}
	layout, err := fileLayout()
	if err != nil {
		return err
	}
	return config.Print(w, fs, vals, layout, head)
}
