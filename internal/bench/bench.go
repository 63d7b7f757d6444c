// Package bench measures kiln the way a client sees it, beside the floors
// it is judged against: a bare python3 spawn, the same with numpy and
// pandas imported. Every kiln number goes through a real MCP client
// speaking JSON-RPC over stdio to a `kiln mcp` child process, so it
// includes the protocol, the session layer, the pool and the backend.
//
// Backends plug in through the server's own --backend flag; what the
// bench must know of one (how its boxes are found, which rows apply) are
// its Traits, which kiln bench takes from the backend's registry entry.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// Options configure a run. Zero values mean defaults.
type Options struct {
	// Kiln is the kiln binary to start as `kiln mcp`. Default: the running
	// executable.
	Kiln string
	// Backend is passed as --backend. Default "jail".
	Backend string
	// Traits are what the bench knows of Backend; Jail those of the jail,
	// for the local jail server measured alongside a cluster backend.
	Traits Traits
	Jail   Traits
	// Alongside are other backends a cluster run (Traits.Nodes) measures
	// row by row as it does the jail: the Pod-per-box kubernetes backend,
	// say, beside the node daemons, in the same run. Their servers get
	// ServerArgs too.
	Alongside []Alongside
	// ServerArgs are added to every `kiln mcp` command line (limits,
	// --preload, --agent …); ServerEnv to its environment.
	ServerArgs []string
	ServerEnv  []string
	// Python is the interpreter of the bare-spawn baselines. Default
	// /usr/bin/python3.
	Python string
	// Bwrap is bubblewrap, the baseline a user would pick instead of a
	// jail: looked up in $PATH; where it is missing, its rows say so.
	// Default "bwrap".
	Bwrap string
	// Iterations is the number of samples of each latency. Default 50.
	Iterations int
	// Duration is how long each throughput level runs. Default 5s.
	Duration time.Duration
	// Clients are the concurrency levels of the throughput runs.
	// Default 1, 2, 8.
	Clients []int
	// Pool and PoolWorkers are passed as --pool and --pool-workers.
	// Default 2 and 1.
	Pool        int
	PoolWorkers int
	// IdleBoxes is how many idle boxes the memory figures look at.
	// Default 4.
	IdleBoxes int
	// Settle is the pause before each first call on a new session, so
	// that it meets a warm pool as a new session usually does. Default 1s.
	Settle time.Duration
	// Gap is the pause between the per-call runs of the warm series, long
	// enough for the pool to refill. Default 100ms.
	Gap time.Duration
	// Skip names measurements to leave out (prefixes of their keys:
	// "spawn", "bwrap", "fork", "pipe", "jupyter", "native", "coldstart", "session", "first", "percall",
	// "percall-pandas", "throughput", "hardening", "pss").
	Skip []string
	// Progress, if set, gets a line per measurement as it starts.
	Progress io.Writer
	Logger   *slog.Logger
}

// Alongside is a backend measured beside a cluster run's.
type Alongside struct {
	Backend string
	Traits  Traits
}

// Traits are what the bench knows of a backend; kiln bench takes them from
// its registry entry.
type Traits struct {
	// BoxCgroups: each box has a cgroup of its own under its server's,
	// "<server pid>/<box id>" in kiln's tree; otherwise a box is found as
	// a child process tree of the server.
	BoxCgroups bool
	// Hardening: the backend has the hardening measures a kiln built with
	// BenchKnobsTag can weaken (the hardening rows).
	Hardening bool
	// Cluster: boxes run on a cluster's nodes, not as the server's
	// processes: no PSS rows, but a warm-pool hit and miss, the control
	// plane's CPU and a local jail server alongside.
	Cluster bool
	// Accel, if set, is the accelerator the server's arguments select,
	// named in every kiln figure.
	Accel func(serverArgs []string) string
	// CPUGroups are the cgroups, relative to the CPU accounting
	// hierarchy's root, that the backend moves its boxes' processes to
	// out of the bench's group, "{pid}" standing for the server's pid:
	// their CPU time counts in kiln's figure. Missing groups count
	// nothing (the jail's under cgroup v1, where boxes stay in the
	// bench's cpuacct group).
	CPUGroups []string
	// CPUGroupsNote says what CPUGroups cover, for the report.
	CPUGroupsNote string
	// Native, if set, is the backend's own runtime run as a user would
	// run it for one print(2+2) without kiln (gVisor: runsc do python3
	// -c, with the bench's python): a same-run baseline of the backend's
	// per-call figures. It returns the command, or why it cannot be had
	// on this host.
	Native func(python string) (argv []string, err error)
	// Nodes, when set, is how many kiln node daemons the bench starts
	// for the servers to front (the cluster backend): the servers get
	// their addresses, a local jail server is measured alongside, and
	// the throughput is measured with 1 to Nodes of them.
	Nodes int
}

// Default is the run of kiln bench without flags: a zero field of Options
// takes its value from here (the flags show the same defaults).
var Default = Options{
	Backend:     "jail",
	Python:      "/usr/bin/python3",
	Bwrap:       "bwrap",
	Iterations:  50,
	Duration:    5 * time.Second,
	Clients:     []int{1, 2, 8},
	Pool:        2,
	PoolWorkers: 1,
	IdleBoxes:   4,
	Settle:      time.Second,
	Gap:         100 * time.Millisecond,
}

func (o *Options) defaults() error {
	d := Default
	if o.Kiln == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("finding own executable: %w", err)
		}
		o.Kiln = exe
	}
	if o.Backend == "" {
		o.Backend = d.Backend
	}
	if o.Python == "" {
		o.Python = d.Python
	}
	if o.Bwrap == "" {
		o.Bwrap = d.Bwrap
	}
	if o.Iterations <= 0 {
		o.Iterations = d.Iterations
	}
	if o.Duration <= 0 {
		o.Duration = d.Duration
	}
	if len(o.Clients) == 0 {
		o.Clients = d.Clients
	}
	if o.Pool < 0 {
		o.Pool = 0
	} else if o.Pool == 0 {
		o.Pool = d.Pool
	}
	if o.PoolWorkers <= 0 {
		o.PoolWorkers = d.PoolWorkers
	}
	if o.IdleBoxes <= 0 {
		o.IdleBoxes = d.IdleBoxes
	}
	if o.Settle <= 0 {
		o.Settle = d.Settle
	}
	if o.Gap <= 0 {
		o.Gap = d.Gap
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Measurement is one row of the report.
type Measurement struct {
	Key  string `json:"key"`
	Name string `json:"name"`
	// Unit of P50 and P99: "ms" (wall-clock latency), "ms CPU" (CPU
	// time: of kiln's cgroups where they could be counted, the note says
	// so, else machine-wide), "MiB" or "calls/s".
	Unit string  `json:"unit"`
	N    int     `json:"n"`
	P50  float64 `json:"p50"`
	P99  float64 `json:"p99"`
	// Ratio is P50 over the python3 spawn's P50 (latencies only).
	Ratio float64 `json:"ratio_to_spawn,omitempty"`
	// CgroupCPU is, for a CPU row, the figure counted in the bench's
	// cgroup and the backend's (Report.CPUAccounting says what they
	// cover): P50 when it could be counted. MachineCPU is the same
	// counted machine-wide, other work on the machine included.
	CgroupCPU  float64 `json:"cgroup_cpu_ms,omitempty"`
	MachineCPU float64 `json:"machine_cpu_ms,omitempty"`
	// Boxes counts, for a kiln row, the boxes its server made during it
	// by how each was made ("one-step", "two-step" forks of the jail's
	// template, "direct" starts), from the server's debug log.
	Boxes map[string]int `json:"boxes,omitempty"`
	Note  string         `json:"note,omitempty"`
	Err   string         `json:"error,omitempty"`
}

// Target is one goal of issue 18, checked against this run: Value (in
// Unit) against Limit, which for a relative target is Factor times the
// same run's baseline (the measurement keyed Base).
type Target struct {
	Name   string  `json:"name"`
	Want   string  `json:"want"`
	Got    string  `json:"got"`
	Met    bool    `json:"met"`
	Key    string  `json:"key,omitempty"`
	Value  float64 `json:"value,omitempty"`
	Limit  float64 `json:"limit,omitempty"`
	Unit   string  `json:"unit,omitempty"`
	Base   string  `json:"base,omitempty"`
	Factor float64 `json:"factor,omitempty"`
	// Bound says what bounds a target that is not met, when known.
	Bound string `json:"bound,omitempty"`
}

// Report is the outcome of a run.
type Report struct {
	Backend string `json:"backend"`
	// Accel is the microVM accelerator in use ("kvm" or "tcg"); empty for
	// other backends. Every kiln figure of a microVM run names it.
	Accel       string    `json:"accel,omitempty"`
	Kiln        string    `json:"kiln"` // the binary under test
	ServerArgs  []string  `json:"server_args,omitempty"`
	ServerEnv   []string  `json:"server_env,omitempty"`
	Pool        int       `json:"pool"`
	PoolWorkers int       `json:"pool_workers"`
	CPUs        int       `json:"cpus"`
	Go          string    `json:"go"`
	Started     time.Time `json:"started"`
	// LoadAverage is /proc/loadavg at the start and the end of the run:
	// other work on the machine inflates every latency.
	LoadAverage []string      `json:"load_average,omitempty"`
	Elapsed     time.Duration `json:"elapsed_ns"`
	// IdleBusy is the share of the machine's CPU time busy while kiln
	// was idle (the cpu-idle row): other work in every machine-wide
	// figure.
	IdleBusy float64 `json:"idle_busy,omitempty"`
	// CPUAccounting says what the cgroup figures of CPU rows cover.
	CPUAccounting string `json:"cpu_accounting,omitempty"`
	// Boxes counts every box the servers made by how it was made.
	Boxes        map[string]int `json:"boxes,omitempty"`
	Measurements []Measurement  `json:"measurements"`
	Targets      []Target       `json:"targets"`
}

func (r *Report) get(key string) *Measurement {
	for i := range r.Measurements {
		if r.Measurements[i].Key == key {
			return &r.Measurements[i]
		}
	}
	return nil
}

type runner struct {
	opts      Options
	log       *slog.Logger
	rep       *Report
	cpu       *cpuGroup  // nil: CPU time not counted
	boxTotals *boxCounts // every server's boxes, by how each was made
	nodes     *nodeSet   // the kiln nodes the servers front (Traits.Nodes)
}

// Run takes every measurement and checks the targets. A measurement that
// fails is reported with its error; Run fails only when nothing could be
// measured.
func Run(ctx context.Context, opts Options) (*Report, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	r := &runner{opts: opts, log: opts.Logger, rep: &Report{
		Backend: opts.Backend, Kiln: opts.Kiln, ServerArgs: opts.ServerArgs, ServerEnv: opts.ServerEnv,
		Pool: opts.Pool, PoolWorkers: opts.PoolWorkers,
		CPUs: runtime.NumCPU(), Go: runtime.Version(), Started: time.Now(),
		LoadAverage: []string{loadAverage()},
	}, boxTotals: &boxCounts{}}
	if opts.Traits.Accel != nil {
		r.rep.Accel = opts.Traits.Accel(opts.ServerArgs)
	}
	if g, err := newCPUGroup(); err != nil {
		r.log.Debug("not counting CPU time", "err", err)
	} else {
		r.cpu = g
		r.rep.CPUAccounting = g.covers()
		if opts.Traits.CPUGroupsNote != "" {
			r.rep.CPUAccounting += "; " + opts.Traits.CPUGroupsNote
		}
		defer g.close()
	}
	if opts.Traits.Cluster {
		// A box's processes are the kubelet's, not the server's children.
		r.opts.Skip = append(r.opts.Skip, "pss")
	}
	steps := []step{
		{"spawn", r.spawn},
		{"bwrap", r.bwrap},
		{"fork", r.fork},
		{"pipe", r.pipe},
		{"jupyter", r.jupyter},
		{"native", r.native},
		{"coldstart", r.coldStart},
		{"session", r.session},
		{"percall", r.perCall},
		{"throughput", r.throughput},
		{"hardening", r.hardening},
		{"network", r.network},
		{"pss", r.memory},
	}
	steps = append(steps, r.kubernetesSteps()...)
	steps = append(steps, r.nodeSteps()...)
	if n := opts.Traits.Nodes; n > 0 {
		ns, err := r.startNodes(ctx, n)
		if err != nil {
			return r.rep, fmt.Errorf("starting the kiln nodes: %w", err)
		}
		defer ns.stop()
		r.nodes = ns
		// Before the user's flags, which may name other nodes.
		r.opts.ServerArgs = append(ns.frontArgs(n), r.opts.ServerArgs...)
	}
	var errs []error
	for _, s := range steps {
		if r.skipped(s.key) {
			continue
		}
		if err := s.fn(ctx); err != nil {
			if ctx.Err() != nil {
				return r.rep, ctx.Err()
			}
			errs = append(errs, fmt.Errorf("%s: %w", s.key, err))
			r.add(Measurement{Key: s.key, Name: s.key, Err: err.Error()})
		}
	}
	r.rep.Elapsed = time.Since(r.rep.Started)
	r.rep.Boxes = r.boxTotals.snapshot()
	r.rep.LoadAverage = append(r.rep.LoadAverage, loadAverage())
	r.pairJail()
	r.ratios()
	r.targets()
	if len(errs) > 0 && len(errs) == len(r.rep.Measurements) {
		return r.rep, errors.Join(errs...)
	}
	return r.rep, nil
}

func (r *runner) skipped(key string) bool {
	for _, s := range r.opts.Skip {
		if s != "" && strings.HasPrefix(key, s) {
			return true
		}
	}
	return false
}

func (r *runner) progress(format string, args ...any) {
	if r.opts.Progress != nil {
		fmt.Fprintf(r.opts.Progress, format+"\n", args...)
	}
}

func (r *runner) add(m Measurement) { r.rep.Measurements = append(r.rep.Measurements, m) }

// latency adds a row from samples.
func (r *runner) latency(key, name string, samples []time.Duration, note string) {
	m := Measurement{Key: key, Name: name, Unit: "ms", N: len(samples), Note: note}
	m.P50, m.P99 = percentiles(samples)
	r.add(m)
}

// percentiles of latencies, in milliseconds.
func percentiles(samples []time.Duration) (p50, p99 float64) {
	ms := make([]float64, len(samples))
	for i, d := range samples {
		ms[i] = float64(d) / float64(time.Millisecond)
	}
	return quantiles(ms)
}

// quantiles returns the nearest-rank median and 99th percentile.
func quantiles(vals []float64) (p50, p99 float64) {
	if len(vals) == 0 {
		return 0, 0
	}
	s := slices.Clone(vals)
	slices.Sort(s)
	at := func(q float64) float64 { return s[int(q*float64(len(s)-1)+0.5)] }
	return at(0.50), at(0.99)
}

func (r *runner) ratios() {
	base := r.rep.get("spawn")
	if base == nil || base.P50 == 0 {
		return
	}
	for i := range r.rep.Measurements {
		m := &r.rep.Measurements[i]
		if m.Unit == "ms" && m.Err == "" {
			m.Ratio = m.P50 / base.P50
		}
	}
}

// --- baselines ---

func (r *runner) spawn(ctx context.Context) error {
	cases := []struct {
		key, name, code, want string
		n                     int
	}{
		{"spawn", "python3 -c 'print(2+2)' spawn", "print(2+2)", "4\n", r.opts.Iterations},
		{"spawn-numpy", "python3 -c 'import numpy, pandas' spawn", "import numpy, pandas", "", max(r.opts.Iterations/5, 5)},
	}
	for _, c := range cases {
		if r.skipped(c.key) {
			continue
		}
		r.progress("measuring %s", c.name)
		var samples []time.Duration
		w := r.cpuStart(nil)
		for range c.n {
			start := time.Now()
			out, err := exec.CommandContext(ctx, r.opts.Python, "-c", c.code).CombinedOutput()
			d := time.Since(start)
			if err != nil || string(out) != c.want {
				return fmt.Errorf("running %s -c %q: %v: %s", r.opts.Python, c.code, err, out)
			}
			samples = append(samples, d)
		}
		span := w.stop()
		r.latency(c.key, c.name, samples, r.opts.Python)
		if c.key == "spawn" {
			r.cpuRow("cpu-spawn", "CPU per python3 -c spawn", span, len(samples),
				"the bench's cgroup over the spawn series / spawns")
		}
	}
	return nil
}

// --- kiln through MCP ---

// server is a `kiln mcp` child process with a connected MCP client.
type server struct {
	cmd   *exec.Cmd
	cs    *mcp.ClientSession
	boxes *boxCounts
}

func (r *runner) startServer(ctx context.Context, mode string, pool int) (*server, error) {
	return r.startServerWith(ctx, mode, pool)
}

// startServerWith is startServer with extra flags after the run's own.
func (r *runner) startServerWith(ctx context.Context, mode string, pool int, extra ...string) (*server, error) {
	args := []string{"mcp", "--backend", r.opts.Backend, "--mode", mode,
		"--pool", fmt.Sprint(pool), "--pool-workers", fmt.Sprint(r.opts.PoolWorkers)}
	args = append(args, r.opts.ServerArgs...)
	args = append(args, extra...)
	// Debug logging, for the line each box's creation logs (how it was
	// made).
	args = append(args, "-v")
	cmd := exec.Command(r.opts.Kiln, args...)
	cmd.Env = append(os.Environ(), r.opts.ServerEnv...)
	boxes := &boxCounts{total: r.boxTotals}
	cmd.Stderr = &logWriter{log: r.log, boxes: boxes}
	client := mcp.NewClient(&mcp.Implementation{Name: "kiln-bench", Version: "1"}, nil)
	cs, err := client.Connect(ctx, &mcp.CommandTransport{Command: cmd, TerminateDuration: 10 * time.Second}, nil)
	if err != nil {
		return nil, fmt.Errorf("starting kiln mcp: %w", err)
	}
	return &server{cmd: cmd, cs: cs, boxes: boxes}, nil
}

func (s *server) close() { s.cs.Close() }

func (s *server) pid() int { return s.cmd.Process.Pid }

// call runs a tool and checks that its text contains want.
func (s *server) call(ctx context.Context, tool string, args map[string]any, want string) (time.Duration, error) {
	start := time.Now()
	res, err := s.cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	d := time.Since(start)
	if err != nil {
		return d, fmt.Errorf("calling %s: %w", tool, err)
	}
	text := resultText(res)
	if res.IsError || !strings.Contains(text, want) {
		return d, fmt.Errorf("%s answered %q, want %q", tool, text, want)
	}
	return d, nil
}

func resultText(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if t, ok := c.(*mcp.TextContent); ok {
			b.WriteString(t.Text)
		}
	}
	return b.String()
}

const (
	printCode  = "print(2+2)"
	printWant  = "4"
	pandasCode = "import pandas as pd\ndf = pd.DataFrame({'x': range(1000)})\nprint(int(df.x.sum()))"
	pandasWant = "499500"
)

func runPython(code, session string) map[string]any {
	args := map[string]any{"code": code}
	if session != "" {
		args["session"] = session
	}
	return args
}

func (r *runner) session(ctx context.Context) error {
	srv, err := r.startWarm(ctx, "session", r.opts.Pool)
	if err != nil {
		return err
	}
	defer srv.close()

	if !r.skipped("session-call") {
		r.progress("measuring session calls")
		// The warm-up took boxes from the pool: let it refill first, or
		// the series shares the CPUs with the pool's forks.
		if err := sleep(ctx, r.opts.Settle); err != nil {
			return err
		}
		logged := srv.boxes.callsLogged()
		if _, err := srv.call(ctx, "run_python", runPython(printCode, "bench"), printWant); err != nil {
			return err
		}
		var samples []time.Duration
		for range r.opts.Iterations {
			d, err := srv.call(ctx, "run_python", runPython(printCode, "bench"), printWant)
			if err != nil {
				return err
			}
			samples = append(samples, d)
		}
		r.latency("session-call", "session call print(2+2)", samples, "one session, MCP over stdio")
		// The server's own share of the same calls, from its log: the
		// rest is the MCP client's and the stdio pipes'.
		// The log comes over a pipe of its own: wait a moment for the
		// series' last lines, and leave out the first call's.
		for i := 0; i < 50 && srv.boxes.callsLogged() < logged+1+len(samples); i++ {
			if err := sleep(ctx, 20*time.Millisecond); err != nil {
				return err
			}
		}
		if inServer := srv.boxes.callsSince(logged + 1); len(inServer) > 0 {
			r.latency("session-call-server", "session call print(2+2), in the server", inServer,
				"the same calls, as long as the server's log says each took, from its request to its answer")
		}
		srv.call(ctx, "reset_session", map[string]any{"session": "bench"}, "")
	}

	if !r.skipped("first") {
		n := max(r.opts.Iterations/5, 5)
		r.progress("measuring %d first calls on new sessions (%s apart)", n, r.opts.Settle)
		var samples []time.Duration
		for i := range n {
			if err := sleep(ctx, r.opts.Settle); err != nil {
				return err
			}
			name := fmt.Sprintf("first-%d", i)
			d, err := srv.call(ctx, "run_python", runPython(printCode, name), printWant)
			if err != nil {
				return err
			}
			samples = append(samples, d)
			if _, err := srv.call(ctx, "reset_session", map[string]any{"session": name}, ""); err != nil {
				return err
			}
		}
		r.latency("first-call", "first call on a new session", samples,
			fmt.Sprintf("pool %d, %s between sessions", r.opts.Pool, r.opts.Settle))
	}
	return nil
}

func (r *runner) perCall(ctx context.Context) error {
	srv, err := r.startWarm(ctx, "per-call", r.opts.Pool)
	if err != nil {
		return err
	}
	defer srv.close()
	cases := []struct{ key, name, code, want string }{
		{"percall", "per-call print(2+2), fresh sandbox", printCode, printWant},
		{"percall-pandas", "per-call pandas, fresh sandbox", pandasCode, pandasWant},
	}
	for _, c := range cases {
		if r.skipped(c.key) {
			continue
		}
		// Warm: calls far enough apart for the pool to refill, as an
		// agent's calls usually are; then back to back, where the pool
		// runs dry and every call waits for a box to be made.
		for _, series := range []struct {
			suffix, name string
			gap          time.Duration
		}{
			{"", "", r.opts.Gap},
			{"-b2b", ", back to back", 0},
		} {
			r.progress("measuring %s%s", c.name, series.name)
			if err := sleep(ctx, r.opts.Settle); err != nil {
				return err
			}
			var samples []time.Duration
			made := srv.boxes.snapshot()
			for range r.opts.Iterations {
				if err := sleep(ctx, series.gap); err != nil {
					return err
				}
				d, err := srv.call(ctx, "run_python", runPython(c.code, ""), c.want)
				if err != nil {
					return err
				}
				samples = append(samples, d)
			}
			note := fmt.Sprintf("pool %d, calls %s apart", r.opts.Pool, series.gap)
			if series.gap == 0 {
				note = fmt.Sprintf("pool %d, back to back: the pool runs dry", r.opts.Pool)
			}
			r.latency(c.key+series.suffix, c.name+series.name, samples, note)
			r.boxesMade(c.key+series.suffix, srv.boxes.since(made))
		}
	}
	return nil
}

// throughput runs per-call print(2+2) from n concurrent callers on one
// stdio connection (the server handles calls concurrently) for Duration.
func (r *runner) throughput(ctx context.Context) error {
	srv, err := r.startWarm(ctx, "per-call", r.opts.Pool)
	if err != nil {
		return err
	}
	defer srv.close()
	// The idle baseline: the machine's busy time over an equal interval,
	// the server up with its pool full, nobody calling.
	if err := sleep(ctx, r.opts.Settle); err != nil {
		return err
	}
	if err := r.quiet(ctx); err != nil {
		return err
	}
	r.progress("measuring the idle machine's CPU for %s", r.opts.Duration)
	w := r.cpuStart(srv)
	if err := sleep(ctx, r.opts.Duration); err != nil {
		return err
	}
	idle := w.stop()
	if idle.MachineErr == nil {
		m := Measurement{Key: "cpu-idle", Name: "CPU busy, idle machine, machine-wide", Unit: "ms CPU", N: 1,
			P50: ms(idle.Machine), P99: ms(idle.Machine),
			Note: fmt.Sprintf("all CPUs over %s with the server idle, just before the throughput runs: subtract it from their totals", idle.Elapsed.Round(time.Millisecond))}
		busy := r.busyShare(idle)
		r.rep.IdleBusy = busy
		if busy > busyMachine {
			m.Note += fmt.Sprintf("; WARNING: the machine was %.0f%% busy without kiln, so every machine-wide figure holds other work", 100*busy)
		}
		r.add(m)
	}
	for _, n := range r.opts.Clients {
		r.progress("measuring per-call throughput with %d concurrent clients for %s", n, r.opts.Duration)
		if err := sleep(ctx, r.opts.Settle); err != nil {
			return err
		}
		made := srv.boxes.snapshot()
		w := r.cpuStart(srv)
		l := closedLoop(ctx, n, r.opts.Duration, func() error {
			_, err := srv.call(ctx, "run_python", runPython(printCode, ""), printWant)
			return err
		})
		span := w.stop()
		samples := l.samples
		m := l.measurement(fmt.Sprintf("throughput-%d", n), fmt.Sprintf("per-call throughput, %d client%s", n, plural(n)), "calls")
		r.add(m)
		r.boxesMade(m.Key, srv.boxes.since(made))
		if len(samples) > 0 {
			note := fmt.Sprintf("the %d-client run / calls", n)
			if idle.MachineErr == nil && span.MachineErr == nil && idle.Elapsed > 0 {
				base := time.Duration(float64(idle.Machine) * span.Elapsed.Seconds() / idle.Elapsed.Seconds())
				note += fmt.Sprintf("; machine-wide %.0f ms busy in all, %.0f ms of it the idle baseline: %.1f ms per call net of it",
					ms(span.Machine), ms(base), ms(span.Machine-base)/float64(len(samples)))
			}
			r.cpuRow(fmt.Sprintf("cpu-call-%d", n), fmt.Sprintf("CPU per per-call run, %d client%s", n, plural(n)),
				span, len(samples), note)
		}
	}
	// The same load on bubblewrap, at the highest level.
	if len(r.opts.Clients) > 0 && !r.skipped("throughput-bwrap") {
		r.bwrapThroughput(ctx, slices.Max(r.opts.Clients))
	}
	return nil
}

// cpuUsage is the CPU time of everything in the bench's group, and of
// the bench itself.
func (r *runner) cpuUsage() (all, self time.Duration) {
	if r.cpu == nil {
		return 0, 0
	}
	all, _ = r.cpu.usage()
	return all, selfCPU()
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// memory measures the PSS of idle pooled boxes and of idle sessions.
func (r *runner) memory(ctx context.Context) error {
	find := finderFor(r.opts.Traits.BoxCgroups)
	n := r.opts.IdleBoxes

	r.progress("measuring the memory of %d idle pooled sandboxes", n)
	srv, err := r.startServer(ctx, "per-call", n)
	if err != nil {
		return err
	}
	boxes, err := waitBoxes(ctx, find, srv.pid(), n)
	if err == nil {
		r.addMemory("pooled", "idle pooled sandbox", boxes, srv.pid())
	}
	srv.close()
	if err != nil {
		return err
	}

	r.progress("measuring the memory of %d idle sessions", n)
	srv, err = r.startWarm(ctx, "session", 0)
	if err != nil {
		return err
	}
	defer srv.close()
	for i := range n {
		if _, err := srv.call(ctx, "run_python", runPython(printCode, fmt.Sprintf("idle-%d", i)), printWant); err != nil {
			return err
		}
	}
	boxes, err = waitBoxes(ctx, find, srv.pid(), n)
	if err != nil {
		return err
	}
	r.addMemory("session", "idle session", boxes, srv.pid())
	return nil
}

// addMemory adds the private memory per box (Private_Clean and
// Private_Dirty of its processes: what the box alone costs, whatever
// else runs) and the PSS per box, which shares the template's pages
// among however many boxes are live: it is given at the box count.
func (r *runner) addMemory(key, name string, boxes map[string][]int, serverPid int) {
	var pss, uss []float64 // MiB
	procs := 0
	byRole := map[string][]float64{} // private MiB of each process, by its role
	for _, pids := range boxes {
		var p, u int64
		for _, pid := range pids {
			m, err := readMemory(pid)
			if err != nil {
				continue
			}
			p += m.Pss
			u += m.Private
			procs++
			role := processRole(pid)
			byRole[role] = append(byRole[role], float64(m.Private)/1024)
		}
		pss = append(pss, float64(p)/1024)
		uss = append(uss, float64(u)/1024)
	}
	roles := slices.Sorted(maps.Keys(byRole))
	parts := make([]string, len(roles))
	for i, role := range roles {
		v, _ := quantiles(byRole[role])
		parts[i] = fmt.Sprintf("%s %.2f", role, v)
	}
	u50, u99 := quantiles(uss)
	r.add(Measurement{Key: "private-" + key, Name: "private memory per " + name, Unit: "MiB", N: len(boxes), P50: u50, P99: u99,
		Note: fmt.Sprintf("Private_Clean+Private_Dirty of the box's %d processes (smaps_rollup); by process, p50 MiB: %s",
			procs/max(len(boxes), 1), strings.Join(parts, ", "))})
	p50, p99 := quantiles(pss)
	m := Measurement{Key: "pss-" + key, Name: fmt.Sprintf("PSS per %s, %d live", name, len(boxes)), Unit: "MiB", N: len(boxes), P50: p50, P99: p99,
		Note: fmt.Sprintf("%d processes in %d boxes: shared pages split %d ways and more, so it moves with the box count", procs, len(boxes), len(boxes)),
	}
	if shared, ok := sharedMemory(serverPid, boxes); ok {
		m.Note += fmt.Sprintf("; the server's other helpers (a zygote) %.1f MiB PSS", float64(shared)/1024)
	}
	r.add(m)
}

// waitBoxes waits until the server has at least n boxes and their memory
// has stopped growing (the kernels finished importing).
func waitBoxes(ctx context.Context, find boxFinder, pid, n int) (map[string][]int, error) {
	deadline := time.Now().Add(2 * time.Minute)
	var last int64 = -1
	for time.Now().Before(deadline) {
		if err := sleep(ctx, 500*time.Millisecond); err != nil {
			return nil, err
		}
		boxes, err := find(pid)
		if err != nil {
			return nil, err
		}
		if len(boxes) < n {
			continue
		}
		var total int64
		for _, pids := range boxes {
			for _, p := range pids {
				if m, err := readMemory(p); err == nil {
					total += m.Rss
				}
			}
		}
		if total == last {
			return boxes, nil
		}
		last = total
	}
	return nil, fmt.Errorf("the server did not reach %d idle boxes in time", n)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// --- output ---

// WriteTable prints the report as a table.
func (rep *Report) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "kiln bench: backend %s, pool %d (%d worker%s), %d CPUs, %s, %s\n",
		rep.Backend, rep.Pool, rep.PoolWorkers, plural(rep.PoolWorkers), rep.CPUs, rep.Go, rep.Elapsed.Round(time.Second))
	if len(rep.LoadAverage) > 0 && rep.LoadAverage[0] != "" {
		fmt.Fprintf(w, "load average at start and end: %s\n", strings.Join(rep.LoadAverage, " | "))
	}
	fmt.Fprintf(w, "kiln under test: %s\n", rep.Kiln)
	if rep.CPUAccounting != "" {
		fmt.Fprintf(w, "CPU figures (ms CPU) are cgroup figures, the machine-wide one beside: %s\n", rep.CPUAccounting)
	}
	if len(rep.Boxes) > 0 {
		fmt.Fprintf(w, "boxes the servers made, by how: %s\n", describeBoxes(rep.Boxes))
	}
	if rep.IdleBusy > busyMachine {
		fmt.Fprintf(w, "WARNING: the machine was %.0f%% busy with other work while kiln idled: machine-wide CPU figures are not kiln's\n", 100*rep.IdleBusy)
	}
	if len(rep.ServerArgs) > 0 || len(rep.ServerEnv) > 0 {
		fmt.Fprintf(w, "server: %s %s\n", strings.Join(rep.ServerEnv, " "), strings.Join(rep.ServerArgs, " "))
	}
	fmt.Fprintf(w, "\n%-50s %6s %14s %12s %9s  %s\n", "measurement", "n", "p50", "p99", "× spawn", "notes")
	for _, m := range rep.Measurements {
		if m.Err != "" && m.N == 0 {
			fmt.Fprintf(w, "%-50s %6s %14s %12s %9s  error: %s\n", m.Name, "-", "-", "-", "-", m.Err)
			continue
		}
		p50 := fmt.Sprintf("%s %s", num(m.P50), m.Unit)
		p99 := fmt.Sprintf("%s %s", num(m.P99), m.Unit)
		if m.Unit == "calls/s" || m.Unit == "ms CPU" {
			p99 = "-" // one figure over the whole run
		}
		ratio := "-"
		if m.Ratio > 0 {
			ratio = fmt.Sprintf("%.2f", m.Ratio)
		}
		note := m.Note
		if rep.Accel != "" && !strings.HasPrefix(m.Key, "spawn") {
			note = "accel " + rep.Accel + "; " + note
		}
		if m.Err != "" {
			note += "; error: " + m.Err
		}
		fmt.Fprintf(w, "%-50s %6d %14s %12s %9s  %s\n", m.Name, m.N, p50, p99, ratio, note)
	}
	if len(rep.Targets) > 0 {
		fmt.Fprintf(w, "\ntargets of issues 18, 28 and 29 (relative ones against this run's baselines)\n")
		fmt.Fprintf(w, "%-50s %-30s %-22s %s\n", "target", "want", "got", "")
		for _, t := range rep.Targets {
			verdict := "met"
			if !t.Met {
				verdict = "NOT met"
				if t.Bound != "" {
					verdict += " (" + t.Bound + ")"
				}
			}
			if t.Got == "not measured" {
				verdict = ""
			}
			fmt.Fprintf(w, "%-50s %-30s %-22s %s\n", t.Name, t.Want, t.Got, verdict)
		}
	}
}

// num formats a figure with three significant digits below 10, one
// decimal above.
func num(v float64) string {
	switch {
	case v != 0 && v < 0.1:
		return fmt.Sprintf("%.3f", v)
	case v < 10:
		return fmt.Sprintf("%.2f", v)
	}
	return fmt.Sprintf("%.1f", v)
}

// logWriter forwards the server's stderr to the logger, a line at a time,
// and counts the boxes it reports.
type logWriter struct {
	log   *slog.Logger
	boxes *boxCounts
	mu    sync.Mutex
	buf   []byte
}

func (l *logWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(l.buf, p...)
	for {
		i := strings.IndexByte(string(l.buf), '\n')
		if i < 0 {
			break
		}
		l.boxes.line(string(l.buf[:i]))
		l.log.Debug("kiln mcp", "line", string(l.buf[:i]))
		l.buf = l.buf[i+1:]
	}
	return len(p), nil
}
