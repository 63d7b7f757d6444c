package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"kiln/internal/bench"
)

const benchUsage = `Usage: kiln bench [flags] [-- kiln mcp flags]

Measures, in one run and side by side: the baselines (a bare python3
spawn, with and without numpy and pandas; a bubblewrap spawn, bwrap
--unshare-all python3 -c, skipped with a line saying so where bwrap is not
installed; a fork of a python with the servers' preloads, and the private
memory of one such child; a round trip over a pipe to a python3 loop; a
cell in a Jupyter kernel with the same preloads, and its memory, skipped
with a line saying so without python3-jupyter-client and python3-ipykernel;
with --backend gvisor, runsc do python3 -c, skipped until runsc is built), a
cold "kiln mcp" start to its first result, a session call, the first call
of a new session, a per-call run in a fresh sandbox (print and pandas),
per-call throughput at several concurrencies beside bubblewrap's at the
highest, for the jail the cost of each hardening measure (seccomp,
Landlock, cgroups, zygote rotation; the first three only in a kiln built
with "make bench-kiln"), what a box's network costs at creation
(per-call with no pool, with and without --allow-net, alternating), and
the private memory and PSS of idle sandboxes. CPU figures are the bench's cgroup and the backend's own (the
jail's boxes, runsc's processes), with the machine-wide figure beside
them; each kiln row says how its boxes were made (one-step or two-step
forks of the jail's template, direct starts). Then it checks the targets
of issues 18, 28 and 29, relative ones against this run's baselines.
With --backend cluster it starts two kiln node daemons (the jail) as its
children, fronts them, measures a local jail server alongside, and the
per-call throughput through one node and through both; -alongside
kubernetes measures the Pod-per-box backend row by row beside them. With
--backend kubernetes it also measures a per-call run on a warm-pool hit
and miss, the CPU per box and per session call of the control plane
(kube-apiserver, etcd, kubelet, containerd, shims; from /proc, net of an
idle baseline), and a local jail server alongside. Every kiln figure goes
through a real MCP client talking to "kiln mcp -v" over stdio. Flags
after "--" are passed to every "kiln mcp".

`

func runBench(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, benchUsage); fs.PrintDefaults() }
	var (
		opts      bench.Options
		clients   string
		skip      string
		alongside string
		jsonOut   = fs.String("json", "", "also write the report as JSON to this file")
		verbose   = fs.Bool("v", false, "show the servers' logs on stderr")
	)
	d := bench.Default
	fs.StringVar(&opts.Backend, "backend", d.Backend, "backend of the kiln servers under test: "+backendNames())
	fs.StringVar(&opts.Kiln, "kiln", "", "kiln binary to run as the servers under test, with its kiln-agent beside it (default: this one), to compare builds with the same bench")
	fs.StringVar(&opts.Python, "python", d.Python, "interpreter of the bare-spawn baselines")
	fs.StringVar(&opts.Bwrap, "bwrap", d.Bwrap, "bubblewrap, for the bwrap baselines (looked up in $PATH)")
	fs.IntVar(&opts.Iterations, "n", d.Iterations, "samples per latency")
	fs.DurationVar(&opts.Duration, "duration", d.Duration, "length of each throughput run")
	fs.StringVar(&clients, "clients", joinInts(d.Clients), "concurrent clients of the throughput runs")
	fs.IntVar(&opts.Pool, "pool", d.Pool, "--pool of the servers (sandboxes kept ready)")
	fs.IntVar(&opts.PoolWorkers, "pool-workers", d.PoolWorkers, "--pool-workers of the servers")
	fs.IntVar(&opts.IdleBoxes, "idle", d.IdleBoxes, "idle sandboxes and sessions the memory figures look at")
	fs.DurationVar(&opts.Settle, "settle", d.Settle, "pause before each first call on a new session and each series")
	fs.DurationVar(&opts.Gap, "gap", d.Gap, "pause between the per-call runs of the warm-pool series")
	fs.StringVar(&alongside, "alongside", "", "with --backend cluster: other backends to measure row by row beside it in the same run, as the jail is (kubernetes: the Pod-per-box backend, given its flags)")
	fs.StringVar(&skip, "skip", "", "comma-separated measurements to leave out: spawn, bwrap, fork, pipe, jupyter, native, coldstart, session, first, percall, pandas, throughput, hardening, network, pss")
	var backendArgs []func() ([]string, error)
	for _, e := range registry {
		if e.benchFlags != nil {
			backendArgs = append(backendArgs, e.benchFlags(fs))
		}
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	e := entry(opts.Backend)
	if e == nil {
		return fmt.Errorf("--backend: unknown backend %q (%s)", opts.Backend, backendNames())
	}
	if e.absent != nil {
		return e.absent
	}
	opts.Traits, opts.Jail = e.bench, entry("jail").bench
	for _, name := range splitList(alongside) {
		if e.bench.Nodes == 0 {
			return fmt.Errorf("--alongside: only a cluster run (--backend cluster) measures other backends beside its own, not --backend %s", opts.Backend)
		}
		o := entry(name)
		switch {
		case o == nil:
			return fmt.Errorf("--alongside: unknown backend %q (%s)", name, backendNames())
		case o.absent != nil:
			return fmt.Errorf("--alongside %s: %w", name, o.absent)
		case name == opts.Backend || name == "jail":
			return fmt.Errorf("--alongside %s: it is measured already", name)
		}
		opts.Alongside = append(opts.Alongside, bench.Alongside{Backend: name, Traits: o.bench})
	}
	for _, args := range backendArgs {
		a, err := args()
		if err != nil {
			return err
		}
		opts.ServerArgs = append(opts.ServerArgs, a...)
	}
	opts.ServerArgs = append(opts.ServerArgs, fs.Args()...)
	for _, s := range splitList(clients) {
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			return fmt.Errorf("--clients: %q is not a positive number", s)
		}
		opts.Clients = append(opts.Clients, n)
	}
	for _, s := range splitList(skip) {
		if s == "pandas" {
			s = "percall-pandas"
		}
		opts.Skip = append(opts.Skip, s)
	}
	if opts.Pool == 0 {
		opts.Pool = -1 // bench.Options: negative means no pool
	}
	opts.Progress = stderr
	opts.Logger = slog.New(slog.DiscardHandler)
	if *verbose {
		opts.Logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	ctx, cancel := signalContext()
	defer cancel()
	rep, err := bench.Run(ctx, opts)
	if rep != nil {
		fmt.Fprintln(stdout)
		rep.WriteTable(stdout)
		if *jsonOut != "" {
			if werr := writeJSON(*jsonOut, rep); werr != nil {
				return werr
			}
		}
	}
	if err != nil && ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding report: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing report: %w", err)
	}
	return nil
}
