// Package cli implements kiln's command line: it parses flags and calls
// into the rest of kiln.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/egress"
	"kiln/internal/event"
	"kiln/internal/mcpserver"
	"kiln/internal/sandbox"
	"kiln/internal/session"
)

const usage = `kiln runs the code AI agents write in sandboxes that hold nothing of the host.

Usage:
  kiln mcp [flags]                 MCP over stdio (Claude Desktop, Claude Code, Cursor)
  kiln serve [--addr A] [flags]    MCP over streamable HTTP at /mcp (bearer token, or OAuth with --auth oidc)
  kiln run -c CODE | -f FILE       run once and print the result (--shell for bash)
  kiln install claude-desktop|claude-code|cursor|vscode [--write]
  kiln config print [serve|mcp|run|doctor] [flags]
                                   the effective configuration file (TOML), and where each value came from
  kiln image build [--force]       build the microVM guest image (Debian packages, cached)
  kiln image build --oci REF       build the kubernetes backend's box image and push it to REF (make build-full)
  kiln node --tls DIR [flags]      serve boxes to fronts of --backend cluster; kiln node certs --dir DIR makes the certificates
  kiln k8s seccomp-profile         print kiln's seccomp profile for the kubelet (kubernetes backend; make build-full)
  kiln wasm install                install the pinned Deno and Pyodide (wasm backend; needs npm)
  kiln template create NAME --setup FILE | list | rm NAME
                                   configured templates: files an operator's setup made, in every box (--template)
  kiln doctor                      which backends work here, and why not
  kiln version                     the version, and which optional features this kiln has

Run "kiln <command> -h" for the flags of a command.
`

// Main runs kiln with args and returns the exit status.
func Main(args []string, stdout, stderr io.Writer) int {
	stderr = &lockedWriter{w: stderr}
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	cmd, rest := args[0], args[1:]
	var err error
	switch cmd {
	case "mcp":
		err = runMCP(rest, stdout, stderr)
	case "serve":
		err = runServe(rest, stderr)
	case "run":
		var code int
		code, err = runOnce(rest, stdout, stderr)
		if err == nil {
			return code
		}
	case "install":
		err = runInstall(rest, stdout, stderr)
	case "config":
		err = runConfig(rest, stdout, stderr)
	case "image":
		err = runImage(rest, stdout, stderr)
	case "node":
		err = runNode(rest, stdout, stderr)
	case "k8s":
		err = runK8s(rest, stdout)
	case "wasm":
		err = runWasm(rest, stdout, stderr)
	case "template":
		err = runTemplate(rest, stdout, stderr)
	case "doctor":
		err = runDoctor(rest, stdout, stderr)
	case "bench":
		err = runBench(rest, stdout, stderr)
	case "version", "--version":
		fmt.Fprintln(stdout, "kiln", mcpserver.Version)
		fmt.Fprint(stdout, featureLines())
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
	default:
		fmt.Fprintf(stderr, "kiln: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "kiln:", err)
		return 1
	}
	return 0
}

// common are the flags every serving command shares.
type common struct {
	ignored      []foreignFlag // of other backends, on the command line (parseFlags)
	backend      string
	mode         string
	agent        string
	timeout      time.Duration
	maxTimeout   time.Duration
	memoryMiB    int64
	diskMiB      int64
	pids         int
	cpus         float64
	maxOutput    int
	poolSize     int
	poolWorkers  int
	idleTTL      time.Duration
	bounds       bounds
	resources    resourceFlags
	jobs         jobFlags
	hib          hibernateFlags
	snapshots    snapshotFlags
	preload      string
	allowNet     string
	allowNetFor  string // --allow-net-for: allowlists by principal
	egressHosts  string
	egressListen string
	secrets      string
	tpl          templateFlags
	verbose      bool
	backends     backends          // every registered backend, with its own flags
	obs          obsFlags          // audit log and metrics (kiln mcp and serve only)
	netScope     string            // not a flag: kiln serve --auth oidc's network scope
	tokens       []mcpserver.Token // not a flag: kiln serve's tokens, which an off-loopback metrics listener requires
}

func (c *common) register(fs *flag.FlagSet) {
	c.registerBox(fs)
	fs.StringVar(&c.mode, "mode", "session", "session (state persists per session) or per-call (a fresh sandbox for every call)")
	fs.DurationVar(&c.timeout, "timeout", session.DefaultTimeout, "default time limit of a call")
	fs.DurationVar(&c.maxTimeout, "max-timeout", session.DefaultMaxTimeout, "largest time limit a call may ask for")
	fs.IntVar(&c.maxOutput, "max-output", agentproto.DefaultMaxOutput, "bytes of stdout and of stderr a result shows per call (head and tail); see --keep-output")
	fs.IntVar(&c.poolSize, "pool", 1, "sandboxes kept ready ahead of demand")
	fs.IntVar(&c.poolWorkers, "pool-workers", 1, "sandboxes prepared at once when refilling the pool")
	fs.DurationVar(&c.idleTTL, "idle-ttl", session.DefaultIdleTTL, "destroy a session's sandbox after this long unused")
	c.bounds.register(fs)
	c.resources.register(fs)
	c.jobs.register(fs)
	c.hib.register(fs)
	c.snapshots.register(fs)
	fs.StringVar(&c.allowNet, "allow-net", "", "hosts sandboxes may reach over HTTP(S), comma-separated: host, *.domain, host:port (default: none, loopback only)")
	fs.StringVar(&c.allowNetFor, "allow-net-for", "", "allowlists of named clients (HTTP token or OIDC principals; * for every other client), each within --allow-net: PRINCIPAL=HOSTS entries separated by ;, HOSTS as --allow-net takes them, empty for no network, e.g. 'ci=pypi.org,files.pythonhosted.org; *=' (default: every client gets --allow-net)")
	fs.StringVar(&c.egressHosts, "egress-hosts", "", "hosts file (/etc/hosts format) the egress gateway resolves names with before DNS")
	fs.StringVar(&c.egressListen, "egress-listen", "", "an IPv4 address of this kiln that the boxes reach over the network, where the egress gateway serves their DNS (port 53) and HTTP proxy (3128): required with --allow-net on the kubernetes backend (in a Pod, its own IP), unused by the others, which wire each box to the gateway themselves")
	fs.StringVar(&c.secrets, "egress-secrets", "", "credentials the egress gateway adds to HTTPS requests, comma-separated NAME@HOST=env:VAR or NAME@HOST=file:PATH: a box sees $NAME as a placeholder, and the gateway puts the value in its requests' headers to HOST alone (HOST must be in --allow-net)")
	groupUsage(fs)
}

// registerBox defines the flags of how boxes are made and what each and
// all of them may use: every serving command's, and all of kiln node's.
func (c *common) registerBox(fs *flag.FlagSet) {
	fs.StringVar(&c.backend, "backend", "jail", "isolation backend: "+backendNames())
	fs.StringVar(&c.agent, "agent", "", "path of kiln-agent (default: next to kiln, then $PATH)")
	fs.Int64Var(&c.memoryMiB, "memory", sandbox.DefaultLimits.MemoryBytes>>20, "memory limit per sandbox, MiB")
	fs.Int64Var(&c.diskMiB, "disk", sandbox.DefaultLimits.WorkspaceBytes>>20, "workspace size per sandbox, MiB")
	fs.IntVar(&c.pids, "pids", sandbox.DefaultLimits.Pids, "process limit per sandbox")
	fs.Float64Var(&c.cpus, "cpus", sandbox.DefaultLimits.CPUs, "CPU limit per sandbox, cores")
	c.bounds.registerBoxes(fs)
	fs.StringVar(&c.preload, "preload", strings.Join(sandbox.DefaultPreload, ","), "Python modules imported before the first call (skipped when missing)")
	c.tpl.register(fs)
	c.backends = registerBackends(fs)
	fs.BoolVar(&c.verbose, "v", false, "debug logging on stderr")
}

func (c *common) logger(stderr io.Writer) *slog.Logger {
	level := slog.LevelInfo
	if c.verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	for _, f := range c.ignored {
		log.Warn("--"+f.flag+" is a flag of --backend "+f.backend+", and this server runs --backend "+c.backend+": it does nothing here", "flag", f.flag)
	}
	return log
}

func (c *common) limits() sandbox.Limits {
	return sandbox.Limits{
		MemoryBytes:    c.memoryMiB << 20,
		WorkspaceBytes: c.diskMiB << 20,
		Pids:           c.pids,
		CPUs:           c.cpus,
	}
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// network is the egress configuration of a server.
type network struct {
	policy  egress.Policy
	per     principalNets   // nil: every principal gets policy
	gateway *egress.Gateway // nil when the policy is empty
}

func (c *common) network(log *slog.Logger, obs event.Observer) (*network, error) {
	p, err := egress.ParsePolicy(splitList(c.allowNet)...)
	if err != nil {
		return nil, fmt.Errorf("--allow-net: %w", err)
	}
	var secrets []egress.Secret
	for _, spec := range splitList(c.secrets) {
		s, err := egress.ParseSecret(spec)
		if err != nil {
			return nil, fmt.Errorf("--egress-secrets: %w", err)
		}
		if !p.AllowsName(s.Host) {
			return nil, fmt.Errorf("--egress-secrets: %s is for %s, which --allow-net does not allow, so no box could use it", s.Name, s.Host)
		}
		secrets = append(secrets, s)
	}
	n := &network{policy: p}
	if n.per, err = parsePrincipalNets(c.allowNetFor, p); err != nil {
		return nil, err
	}
	if p.Empty() {
		return n, nil
	}
	var listen netip.Addr
	if c.egressListen != "" && wiresOwnEgress(c.backend) {
		return nil, fmt.Errorf("--egress-listen is for backends whose boxes reach the gateway over a network (kubernetes); the %s backend wires each box to the gateway itself: leave it out", c.backend)
	}
	if c.egressListen != "" {
		if listen, err = netip.ParseAddr(c.egressListen); err != nil {
			return nil, fmt.Errorf("--egress-listen: %w", err)
		}
	}
	if n.gateway, err = egress.NewGateway(egress.Options{Logger: log, HostsFile: c.egressHosts, Observer: obs, Secrets: secrets, Listen: listen}); err != nil {
		return nil, fmt.Errorf("starting the egress gateway: %w", err)
	}
	return n, nil
}

// stack is a running backend, session manager and MCP server.
type stack struct {
	net     *network
	backend sandbox.Backend
	mgr     *session.Manager
	ledger  session.Ledger // nil: none
	srv     *mcpserver.Server
	obs     *observers
	state   *session.StateLock // nil: no --state-dir
}

// start holds --state-dir for this server, then starts the rest.
func (c *common) start(ctx context.Context, log *slog.Logger) (*stack, error) {
	lock, err := c.lockState(ctx, log)
	if err != nil {
		return nil, err
	}
	st, err := c.startLocked(ctx, log)
	if err != nil {
		lock.Close()
		return nil, err
	}
	st.state = lock
	return st, nil
}

// lockState takes --state-dir, if there is one, waiting for a server
// that stops there for as long as it may spend saving its sessions.
func (c *common) lockState(ctx context.Context, log *slog.Logger) (*session.StateLock, error) {
	if c.snapshots.stateDir == "" {
		return nil, nil
	}
	dir, err := filepath.Abs(c.snapshots.stateDir)
	if err != nil {
		return nil, err
	}
	if err := session.PrepareStateDir(dir); err != nil {
		return nil, err
	}
	return session.LockStateDir(ctx, dir, max(c.hib.saveTimeout, 0)+stateLockSlack, log)
}

// stateLockSlack is how much longer than --hibernate-shutdown-time a
// server waits for another to let go of --state-dir.
const stateLockSlack = 5 * time.Second

func (c *common) startLocked(ctx context.Context, log *slog.Logger) (*stack, error) {
	mode := session.Mode(c.mode)
	if mode != session.ModeSession && mode != session.ModePerCall {
		return nil, fmt.Errorf("--mode must be session or per-call, not %q", c.mode)
	}
	if err := c.resources.check(c.maxOutput); err != nil {
		return nil, err
	}
	hib, err := c.hib.options(ctx, c.snapshots.stateDir)
	if err != nil {
		return nil, err
	}
	tpl, err := c.tpl.load(c.backend)
	if err != nil {
		return nil, err
	}
	preload := templatePreload(tpl, splitList(c.preload))
	obs, err := c.obs.open(c.backend, log)
	if err != nil {
		return nil, err
	}
	net, err := c.network(log, obs.observer())
	if err != nil {
		obs.close()
		return nil, err
	}
	maxBoxes, all := c.bounds.resolve(c.limits())
	var ledger session.Ledger
	env := backendEnv{agent: c.agent, net: net, allBoxes: all, log: log, ledger: &ledger}
	if tpl != nil {
		env.template = tpl.FilesDir()
		log.Info("serving from a template", "template", tpl.Name, "import", tpl.Import)
	}
	b, err := c.backends.newBackend(ctx, c.backend, env)
	if err != nil {
		if net.gateway != nil {
			net.gateway.Close()
		}
		obs.close()
		return nil, fmt.Errorf("starting %s backend: %w", c.backend, err)
	}
	mgr := session.NewManager(c.bounds.apply(maxBoxes, session.Options{
		Backend:        b,
		Mode:           mode,
		Limits:         c.limits(),
		Preload:        preload,
		DefaultTimeout: c.timeout,
		MaxTimeout:     c.maxTimeout,
		IdleTTL:        c.idleTTL,
		MaxOutput:      c.resources.kept(c.maxOutput),
		PoolSize:       c.poolSize,
		PoolWorkers:    c.poolWorkers,
		Jobs:           c.jobs.options(),
		Hibernate:      hib,
		Snapshots:      c.snapshots.options(),
		StateQuota:     c.snapshots.stateQuota(),
		Logger:         log,
		Observer:       obs.observer(),
		Ledger:         ledger,
	}))
	if w, ok := b.(sandbox.Warmer); ok {
		spec := sandbox.Spec{Limits: mgr.Options().Limits, Preload: preload}
		go func() {
			if err := w.Warm(ctx, spec); err != nil {
				log.Warn("preparing the template ahead of demand", "err", err)
				return
			}
			obs.warm.Store(true)
		}()
	} else {
		obs.warm.Store(true)
	}
	var rt sandbox.Runtime
	if d, ok := b.(sandbox.Describer); ok {
		rt = d.Runtime()
	}
	if tpl != nil {
		rt.Notes = append(rt.Notes, templateNote(tpl))
	}
	netDesc := ""
	if !net.policy.Empty() {
		netDesc = egress.Describe(net.policy)
		log.Info("egress allowed", "hosts", net.policy.String())
		if c.netScope != "" {
			netDesc += " Only for clients whose token holds the scope " + c.netScope + "; for others the network is cut."
		}
	}
	var networkFor func(string) (mcpserver.PrincipalNetwork, bool)
	if net.per != nil {
		networkFor = net.per.lookup
		log.Info("egress allowlists by client", "allow_net_for", net.per.String())
	}
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Runtime: rt, Backend: b.Name(), Network: netDesc, Logger: log,
		NetScope: c.netScope, NetworkFor: networkFor, Resources: c.resources.options(c.maxOutput)})
	st := &stack{net: net, backend: b, mgr: mgr, ledger: ledger, srv: srv, obs: obs}
	if err := obs.serve(c.obs.metricsAddr, c.tokens, mgr); err != nil {
		st.close()
		return nil, err
	}
	return st, nil
}

func (s *stack) close() {
	s.mgr.Close()
	s.backend.Close()
	if c, ok := s.ledger.(io.Closer); ok {
		c.Close() // after the sessions: this front's count goes last
	}
	if s.net.gateway != nil {
		s.net.gateway.Close()
	}
	s.obs.close()
	s.state.Close() // last: the sessions are saved
}

func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}

func runMCP(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln mcp", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c common
	c.register(fs)
	c.obs.register(fs)
	if err := c.parseFlags(fs, args); err != nil {
		return err
	}
	log := c.logger(stderr)
	ctx, cancel := signalContext()
	defer cancel()
	st, err := c.start(ctx, log)
	if err != nil {
		return err
	}
	defer st.close()
	log.Info("kiln serving MCP on stdio", "backend", c.backend, "mode", c.mode)
	// Only protocol goes to stdout: the transport owns os.Stdout.
	err = st.srv.MCP().Run(ctx, mcpserver.NewStdioTransport(os.Stdin, os.Stdout))
	if err != nil && ctx.Err() == nil && !errors.Is(err, io.EOF) {
		return err
	}
	return nil
}

func runServe(args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c common
	c.register(fs)
	c.obs.register(fs)
	addr := fs.String("addr", "127.0.0.1:8080", "address to listen on")
	tokenFile := fs.String("token-file", "", "file of bearer tokens, one per line (\"principal:token\" or \"token\"), readable by its owner only; KILN_TOKEN adds one")
	httpFlags := registerHTTPLimits(fs)
	authF := registerAuth(fs)
	if err := c.parseFlags(fs, args); err != nil {
		return err
	}
	toks, err := mcpserver.LoadTokens(os.Getenv("KILN_TOKEN"), *tokenFile)
	if err != nil {
		return err
	}
	if authF.mode == "oidc" && len(toks) > 0 {
		return errors.New("KILN_TOKEN and --token-file are for --auth tokens; with --auth oidc, clients bring tokens of --oidc-issuer")
	}
	log := c.logger(stderr)
	ctx, cancel := signalContext()
	defer cancel()
	verifier, oauthOpts, err := authF.oidc(ctx, log)
	if err != nil {
		return err
	}
	if verifier != nil {
		defer verifier.Close()
		c.netScope = verifier.NetScope()
	} else if err := mcpserver.CheckListen(*addr, toks); err != nil {
		return err
	}
	c.tokens = toks
	st, err := c.start(ctx, log)
	if err != nil {
		return err
	}
	defer st.close()
	lim := httpFlags.limits()
	hs, ln, err := listenHTTP(st.srv, *addr, mcpserver.HTTPOptions{Tokens: toks, OAuth: oauthOpts, Limits: &lim})
	if err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	log.Info("kiln serving MCP over HTTP", "url", "http://"+*addr+"/mcp", "backend", c.backend, "mode", c.mode, "auth", authF.mode, "authenticated", len(toks) > 0 || verifier != nil)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	// In-flight calls get a moment to finish; idle keep-alive connections
	// (clients that went away) must not hold the exit up.
	sctx, scancel := context.WithTimeout(context.Background(), time.Second)
	defer scancel()
	if err := hs.Shutdown(sctx); err != nil {
		return hs.Close()
	}
	return nil
}

func runOnce(args []string, stdout, stderr io.Writer) (int, error) {
	fs := flag.NewFlagSet("kiln run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c common
	c.register(fs)
	code := fs.String("c", "", "code to run")
	file := fs.String("f", "", "file of code to run (- for stdin)")
	shell := fs.Bool("shell", false, "run as a bash command line instead of Python")
	images := fs.String("images", "", "directory to save images to (default: only list them)")
	if err := c.parseFlags(fs, args); err != nil {
		return 0, err
	}
	src := *code
	switch {
	case *code != "" && *file != "":
		return 0, errors.New("give -c or -f, not both")
	case *file == "-":
		b, err := io.ReadAll(os.Stdin)
		if err != nil {
			return 0, err
		}
		src = string(b)
	case *file != "":
		b, err := os.ReadFile(*file)
		if err != nil {
			return 0, err
		}
		src = string(b)
	case *code == "":
		return 0, errors.New("give code with -c CODE or -f FILE")
	}
	c.poolSize = 0
	c.mode = string(session.ModePerCall)
	log := c.logger(stderr)
	if !c.verbose {
		log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	ctx, cancel := signalContext()
	defer cancel()
	st, err := c.start(ctx, log)
	if err != nil {
		return 0, err
	}
	defer st.close()
	tool := "run_python"
	argsJSON := map[string]any{"code": src}
	if *shell {
		tool = "run_shell"
		argsJSON = map[string]any{"command": src}
	}
	res, err := callInMemory(ctx, st.srv, tool, argsJSON)
	if err != nil {
		return 0, err
	}
	printResult(stdout, res, *images)
	if res.IsError {
		return 1, nil
	}
	return 0, nil
}

// callInMemory calls a tool through a real MCP client over the SDK's
// in-memory transport, so `kiln run` prints exactly what a client gets.
func callInMemory(ctx context.Context, srv *mcpserver.Server, tool string, args map[string]any) (*mcp.CallToolResult, error) {
	ct, stt := mcp.NewInMemoryTransports()
	ss, err := srv.MCP().Connect(ctx, stt, nil)
	if err != nil {
		return nil, err
	}
	defer ss.Close()
	client := mcp.NewClient(&mcp.Implementation{Name: "kiln-run", Version: mcpserver.Version}, nil)
	cs, err := client.Connect(ctx, ct, nil)
	if err != nil {
		return nil, err
	}
	defer cs.Close()
	return cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
}

// printResult shows a result to a person: control characters from the box
// are made visible (see visible), on a terminal or not.
func printResult(w io.Writer, res *mcp.CallToolResult, imageDir string) {
	n := 0
	for _, c := range res.Content {
		switch c := c.(type) {
		case *mcp.TextContent:
			fmt.Fprintln(w, visible(c.Text))
		case *mcp.ImageContent:
			n++
			if imageDir == "" {
				fmt.Fprintf(w, "[image %d: %s, %d bytes; save with --images DIR]\n", n, visible(c.MIMEType), len(c.Data))
				continue
			}
			ext := strings.TrimPrefix(c.MIMEType, "image/")
			if strings.Trim(ext, "abcdefghijklmnopqrstuvwxyz0123456789+") != "" || ext == "" {
				ext = "bin" // never a path
			}
			p := filepath.Join(imageDir, fmt.Sprintf("kiln-image-%d.%s", n, ext))
			if err := os.WriteFile(p, c.Data, 0o644); err != nil {
				fmt.Fprintf(w, "[image %d: %s]\n", n, visible(err.Error()))
			} else {
				fmt.Fprintf(w, "[image %d saved to %s]\n", n, p)
			}
		case *mcp.EmbeddedResource:
			if c.Resource != nil {
				fmt.Fprintf(w, "[resource %s, %d bytes]\n", visible(c.Resource.URI), len(c.Resource.Blob))
			}
		}
	}
}

// lockedWriter serializes writes to stderr. Logs reach it from the
// server's goroutines (the egress gateway's DNS handler, for one) while a
// command prints its own lines; an *os.File takes that, a caller's buffer
// does not.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
