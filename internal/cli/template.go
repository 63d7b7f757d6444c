package cli

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"kiln/internal/boxpolicy"
	"kiln/internal/boxtemplate"
	"kiln/internal/config"
	"kiln/internal/mcpserver"
	"kiln/internal/sandbox"
)

const templateUsage = `Usage:
  kiln template create NAME --setup FILE [--import MODULES] [--allow-net HOSTS] [--backend jail|gvisor] [flags]
  kiln template list
  kiln template rm NAME

A template is what an operator's setup code leaves in a box: Python
packages installed with pip --target "$KILN_TEMPLATE_FILES/python", data files
under "$KILN_TEMPLATE_FILES". kiln template create starts a box (jail,
or gvisor with --backend gvisor) whose /template is writable, runs FILE in
it once (python3 if it ends in .py, else bash) under the template's
network policy (--allow-net, as kiln serve has it; default: no network),
and keeps what it wrote. A server started
with --template NAME shows those files read-only at /template in every
box, with /template/python on PYTHONPATH, and imports the --import
modules before each box is handed out (on the jail, the zygote imports
them once, before it forks; on gvisor, the warm-start box imports them
before its checkpoint). Templates record the kiln version and the
backend that made them, and a server refuses one that does not match.

Templates live in --template-dir (or KILN_TEMPLATE_DIR); default
/var/lib/kiln/templates as root, else kiln's directory in the user's cache.
The jail and gvisor backends make and serve templates; microvm serves
templates made on the jail (packed into a read-only disk); wasm does not.
`

// runTemplate is "kiln template".
func runTemplate(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, templateUsage)
		return errors.New("kiln template: expected create, list or rm")
	}
	switch args[0] {
	case "create":
		return runTemplateCreate(args[1:], stdout, stderr)
	case "list", "ls":
		return runTemplateList(args[1:], stdout, stderr)
	case "rm", "remove":
		return runTemplateRemove(args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, templateUsage)
		return flag.ErrHelp
	}
	fmt.Fprint(stderr, templateUsage)
	return fmt.Errorf("kiln template: unknown subcommand %q", args[0])
}

// templateDirFlag defines --template-dir on a template command. The
// function it returns, once fs is parsed, opens the store: in the
// directory the command line names, else the one the configuration layer
// gives the serving commands (KILN_TEMPLATE_DIR, then the file: see
// package config), so both find the same templates.
func templateDirFlag(fs *flag.FlagSet) func() (*boxtemplate.Store, error) {
	dir := fs.String("template-dir", "", "where templates live (default: $KILN_TEMPLATE_DIR, else the configuration file's, else /var/lib/kiln/templates as root, else kiln's directory in the user's cache)")
	return func() (*boxtemplate.Store, error) {
		d := *dir
		if d == "" {
			var err error
			if d, err = configuredTemplateDir(); err != nil {
				return nil, err
			}
		}
		return boxtemplate.Open(d)
	}
}

// configuredTemplateDir is the serving commands' --template-dir as the
// configuration layer resolves it from the environment and the file.
func configuredTemplateDir() (string, error) {
	fs := flag.NewFlagSet("kiln template", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	dir := fs.String("template-dir", "", "")
	if err := parseFlags(fs, nil); err != nil {
		return "", err
	}
	return *dir, nil
}

// parseNamed parses fs from args that hold one NAME before or after the
// flags.
func parseNamed(fs *flag.FlagSet, args []string) (string, error) {
	var name string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		name, args = args[0], args[1:]
	}
	if err := fs.Parse(args); err != nil {
		return "", err
	}
	if name == "" && fs.NArg() > 0 {
		name = fs.Arg(0)
	} else if fs.NArg() > 0 {
		return "", fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if name == "" {
		return "", errors.New("give the template's NAME")
	}
	return name, boxtemplate.ValidName(name)
}

// templateSetup is what kiln template create runs.
type templateSetup struct {
	name        string
	backend     string // jail (default) or gvisor: where the setup runs, and the only backend that serves the template
	store       *boxtemplate.Store
	setup       string // path of the setup file
	imports     []string
	allowNet    string
	egressHosts string
	agent       string
	limits      sandbox.Limits
	timeout     time.Duration
	out         io.Writer // the setup's output, for the operator
	log         *slog.Logger
	net         *network // nil: from allowNet and egressHosts (tests give their own)
}

func runTemplateCreate(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln template create", flag.ContinueOnError)
	fs.SetOutput(stderr)
	openStore := templateDirFlag(fs)
	setup := fs.String("setup", "", "the setup: python3 runs it if it ends in .py, else bash (required)")
	imports := fs.String("import", "", "Python modules every box of the template imports before it is handed out, comma-separated")
	allowNet := fs.String("allow-net", "", "hosts the setup may reach over HTTP(S), comma-separated, as kiln serve's --allow-net (default: none)")
	egressHosts := fs.String("egress-hosts", "", "hosts file (/etc/hosts format) the egress gateway resolves names with before DNS")
	agent := fs.String("agent", "", "path of kiln-agent (default: next to kiln, then $PATH)")
	timeout := fs.Duration("timeout", 30*time.Minute, "time limit of the setup")
	memory := fs.Int64("memory", 2048, "memory limit of the setup's box, MiB")
	disk := fs.Int64("disk", sandbox.DefaultLimits.WorkspaceBytes>>20, "workspace of the setup's box (where it runs), MiB; the template's own files are not in it")
	backend := fs.String("backend", "jail", "backend the setup runs in and the template serves: "+templateMakers())
	verbose := fs.Bool("v", false, "debug logging on stderr")
	name, err := parseNamed(fs, args)
	if err != nil {
		return err
	}
	if *setup == "" {
		return errors.New("give the setup with --setup FILE")
	}
	if err := checkCreateBackend(*backend); err != nil {
		return fmt.Errorf("--backend: %w", err)
	}
	c := common{verbose: *verbose}
	log := c.logger(stderr)
	store, err := openStore()
	if err != nil {
		return err
	}
	ctx, cancel := signalContext()
	defer cancel()
	tpl, err := createTemplate(ctx, templateSetup{
		name: name, backend: *backend, store: store, setup: *setup, imports: splitList(*imports),
		allowNet: *allowNet, egressHosts: *egressHosts, agent: *agent,
		limits:  sandbox.Limits{MemoryBytes: *memory << 20, WorkspaceBytes: *disk << 20},
		timeout: *timeout, out: stderr, log: log,
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "template %s: %d files, %s, setup took %s\n  %s\n", tpl.Name, tpl.Files, humanBytes(tpl.Bytes), tpl.Took.Round(time.Millisecond), tpl.Dir)
	return nil
}

// createTemplate runs the setup in a jail box whose /template is the
// stage's files, then seals and keeps them. The box has the template's
// network policy; the setup runs as the box's unprivileged user, like
// model code, though it is the operator's.
func createTemplate(ctx context.Context, o templateSetup) (_ *boxtemplate.Template, err error) {
	for _, m := range o.imports {
		if !pyModuleName.MatchString(m) {
			return nil, fmt.Errorf("--import: %q is not a Python module name", m)
		}
	}
	code, err := readSetup(o.setup)
	if err != nil {
		return nil, err
	}
	stage, err := o.store.Stage(o.name)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			stage.Abort()
		}
	}()
	net := o.net
	if net == nil {
		c := common{allowNet: o.allowNet, egressHosts: o.egressHosts}
		if net, err = c.network(o.log, nil); err != nil {
			return nil, err
		}
		if net.gateway != nil {
			defer net.gateway.Close()
		}
	}
	b, err := setupBackend(ctx, o, net, stage.Files())
	if err != nil {
		return nil, err
	}
	defer b.Close()
	took, err := runSetup(ctx, b, o, code)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(code)
	return stage.Commit(boxtemplate.Manifest{
		KilnVersion: mcpserver.Version,
		Backend:     b.Name(),
		Created:     time.Now().UTC().Truncate(time.Second),
		Setup:       filepath.Base(o.setup),
		SetupSHA256: hex.EncodeToString(sum[:]),
		AllowNet:    allowNetString(net),
		Import:      o.imports,
		Took:        took,
	})
}

// maxSetup bounds a setup file.
const maxSetup = 1 << 20

// readSetup reads the setup file, checked as the configuration is: what
// it makes is sealed into every box served with the template.
func readSetup(path string) ([]byte, error) {
	f, err := config.OpenTrusted("setup file", path, false)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	code, err := io.ReadAll(io.LimitReader(f, maxSetup+1))
	if err != nil {
		return nil, fmt.Errorf("reading the setup: %w", err)
	}
	if len(code) > maxSetup {
		return nil, fmt.Errorf("the setup %s is over %d bytes", path, maxSetup)
	}
	return code, nil
}

// runSetup runs the setup in a box of b and shows its output.
func runSetup(ctx context.Context, b sandbox.Backend, o templateSetup, code []byte) (time.Duration, error) {
	start := time.Now()
	box, err := b.Create(ctx, sandbox.Spec{ID: "template-" + o.name, Limits: o.limits})
	if err != nil {
		return 0, fmt.Errorf("starting the setup's box: %w", err)
	}
	defer box.Close()
	file, cmd := "kiln-setup.sh", "exec bash kiln-setup.sh"
	if strings.HasSuffix(o.setup, ".py") {
		file, cmd = "kiln-setup.py", "exec python3 kiln-setup.py"
	}
	if err := box.WriteFile(ctx, file, code); err != nil {
		return 0, fmt.Errorf("writing the setup into its box: %w", err)
	}
	tctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	res, err := box.RunShell(tctx, cmd, sandbox.ExecOptions{MaxOutput: 64 << 10})
	if tctx.Err() != nil && ctx.Err() == nil {
		return 0, fmt.Errorf("the setup ran past --timeout %s", o.timeout)
	}
	if err != nil {
		return 0, fmt.Errorf("running the setup: %w", err)
	}
	for _, s := range []string{res.Stdout.Text, res.Stderr.Text} {
		if s != "" {
			fmt.Fprintln(o.out, visible(strings.TrimRight(s, "\n")))
		}
	}
	if res.ExitCode != 0 || res.Signal != "" {
		return 0, fmt.Errorf("the setup failed (exit %d%s); nothing was kept", res.ExitCode, signalSuffix(res.Signal))
	}
	took := time.Since(start)
	if err := checkImports(tctx, box, o.imports); err != nil {
		return 0, err
	}
	return took, nil
}

// checkImports imports each --import module (names checked by
// pyModuleName) in the setup's box, as every
// box of the template will before it is handed out (where a missing one
// is skipped silently): a module the setup did not provide is an error
// now, not a slow first call later.
func checkImports(ctx context.Context, box sandbox.Sandbox, mods []string) error {
	for _, m := range mods {
		// A fresh python, as a box's: the setup box's kernel started
		// before the setup made the template's python directory.
		res, err := box.RunShell(ctx, "out=$(python3 -c 'import importlib, sys; importlib.import_module(sys.argv[1])' "+m+" 2>&1) || { printf '%s\\n' \"$out\" | tail -n 1; exit 1; }", sandbox.ExecOptions{MaxOutput: 4096})
		if err != nil {
			return fmt.Errorf("importing %s after the setup: %w", m, err)
		}
		if res.ExitCode != 0 {
			msg := strings.TrimSpace(res.Stdout.Text)
			return fmt.Errorf("--import %s: the template's boxes cannot import it (%s); nothing was kept", m, visible(msg))
		}
	}
	return nil
}

// pyModuleName is a dotted Python module name.
var pyModuleName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$`)

func signalSuffix(sig string) string {
	if sig == "" {
		return ""
	}
	return ", " + sig
}

func runTemplateList(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln template list", flag.ContinueOnError)
	fs.SetOutput(stderr)
	openStore := templateDirFlag(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	store, err := openStore()
	if err != nil {
		return err
	}
	list, err := store.List()
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tBACKEND\tKILN\tCREATED\tSIZE\tIMPORT\tALLOW-NET")
	for _, l := range list {
		if l.Err != nil {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\tunreadable: %s\n", l.Name, visible(l.Err.Error()))
			continue
		}
		m := l.Template.Manifest
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", l.Name, m.Backend, visible(m.KilnVersion), m.Created.Format(time.RFC3339),
			humanBytes(m.Bytes), orDash(strings.Join(m.Import, ",")), orDash(m.AllowNet))
	}
	return tw.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return visible(s)
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func runTemplateRemove(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln template rm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	openStore := templateDirFlag(fs)
	name, err := parseNamed(fs, args)
	if err != nil {
		return err
	}
	store, err := openStore()
	if err != nil {
		return err
	}
	if err := store.Remove(name); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "removed template %s\n", name)
	return nil
}

// templateFlags are the serving commands' --template and --template-dir.
type templateFlags struct {
	name string
	dir  string
}

func (t *templateFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&t.name, "template", "", "configured template every box starts from (kiln template create): its files are read-only at "+boxpolicy.TemplateDir+" and its modules preloaded; jail, gvisor and microvm (which serves templates made on the jail) backends")
	fs.StringVar(&t.dir, "template-dir", "", "where templates live (default: /var/lib/kiln/templates as root, else kiln's directory in the user's cache)")
}

// load returns the configured template, nil without one. A template the
// backend cannot serve, or one made by another kiln or backend, is
// refused with a message that says so.
func (t *templateFlags) load(backend string) (*boxtemplate.Template, error) {
	if t.name == "" {
		return nil, nil
	}
	if err := checkServeBackend(backend); err != nil {
		return nil, fmt.Errorf("--template: %w", err)
	}
	store, err := boxtemplate.Open(t.dir)
	if err != nil {
		return nil, fmt.Errorf("--template: %w", err)
	}
	tpl, err := store.LoadServed(t.name, mcpserver.Version, backend, servedBy(backend))
	if err != nil {
		return nil, fmt.Errorf("--template: %w", err)
	}
	return tpl, nil
}

// templatePreload is the preload list of a server with template tpl: the
// template's imports first, then --preload's.
func templatePreload(tpl *boxtemplate.Template, preload []string) []string {
	if tpl == nil {
		return preload
	}
	out := slices.Clone(tpl.Import)
	for _, m := range preload {
		if !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	return out
}

// templateNote tells the model about the template's files.
func templateNote(tpl *boxtemplate.Template) string {
	s := fmt.Sprintf("Files the operator prepared (template %s) are at %s, read-only; Python modules under %s are importable", tpl.Name, boxpolicy.TemplateDir, boxpolicy.TemplatePython)
	if len(tpl.Import) > 0 {
		s += " (" + strings.Join(tpl.Import, ", ") + " already imported)"
	}
	return s + "."
}

func allowNetString(n *network) string {
	if n.policy.Empty() {
		return ""
	}
	return n.policy.String()
}
