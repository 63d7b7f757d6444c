package bench

import (
	"context"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

func TestParseProcStat(t *testing.T) {
	stat := "cpu  100 5 50 9000 30 2 3 1 40 0\ncpu0 50 2 25 4500 15 1 1 0 20 0\nintr 1\n"
	got, err := parseProcStat([]byte(stat))
	if err != nil {
		t.Fatal(err)
	}
	// user+nice+system+irq+softirq+steal = 100+5+50+2+3+1 ticks; guest is in user.
	if want := 161 * clockTick; got != want {
		t.Errorf("busy = %s, want %s", got, want)
	}
	for _, bad := range []string{"", "cpu 1 2 3\n", "cpu a b c d e f g h\n", "intr 1\n"} {
		if _, err := parseProcStat([]byte(bad)); err == nil {
			t.Errorf("parseProcStat(%q) accepted it", bad)
		}
	}
}

func TestMachineBusyGrows(t *testing.T) {
	b0, err := machineBusy()
	if err != nil {
		t.Skipf("no /proc/stat: %v", err)
	}
	end := time.Now().Add(300 * time.Millisecond)
	for x := 0; time.Now().Before(end); x++ {
	}
	b1, err := machineBusy()
	if err != nil {
		t.Fatal(err)
	}
	if b1-b0 < 100*time.Millisecond {
		t.Errorf("300ms of spinning counted as %s machine-wide", b1-b0)
	}
}

func TestPipeRoundTrips(t *testing.T) {
	py := "/usr/bin/python3"
	if _, err := os.Stat(py); err != nil {
		if py, err = exec.LookPath("python3"); err != nil {
			t.Skip("no python3")
		}
	}
	s, err := pipeRoundTrips(context.Background(), py, 20)
	if err != nil {
		t.Fatal(err)
	}
	if len(s) != 20 {
		t.Fatalf("%d samples, want 20", len(s))
	}
	// A loop that answers something else is an error, not a sample.
	if _, err := pipeRoundTrips(context.Background(), "/bin/true", 1); err == nil {
		t.Error("a far end that never answers gave samples")
	}
}

func TestTargets(t *testing.T) {
	rep := &Report{Backend: "jail", Measurements: []Measurement{
		{Key: "spawn", Unit: "ms", N: 50, P50: 20},
		{Key: "pipe", Unit: "ms", N: 200, P50: 0.5},
		{Key: "session-call", Unit: "ms", N: 50, P50: 0.6},   // 1.2× pipe: met
		{Key: "percall", Unit: "ms", N: 50, P50: 5},          // 0.25× spawn: not met
		{Key: "percall-b2b", Unit: "ms", N: 50, Err: "boom"}, // not measured
		{Key: "throughput-1", Unit: "calls/s", N: 300, P50: 60},
		{Key: "throughput-2", Unit: "calls/s", N: 500, P50: 100},
		{Key: "cpu-call-1", Unit: "ms CPU", N: 300, P50: 30},
		{Key: "cpu-call-2", Unit: "ms CPU", N: 500, P50: 7},
		{Key: "cpu-bwrap", Unit: "ms CPU", N: 50, P50: 10},             // 0.7× bwrap: met
		{Key: "cpu-fork", Unit: "ms CPU", N: 50, P50: 3},               // 2.3× a fork: not met
		{Key: "throughput-bwrap-2", Unit: "calls/s", N: 200, P50: 40},  // 2.5× bwrap at 2 clients: met
		{Key: "throughput-bwrap-8", Unit: "calls/s", N: 200, P50: 150}, // a level kiln has no row of; never kiln's best
		{Key: "private-pooled", Unit: "MiB", N: 4, P50: 1.5},
	}}
	got := map[string]Target{}
	for _, tg := range rep.checkTargets() {
		got[tg.Name] = tg
	}
	for _, c := range []struct {
		name     string
		met      bool
		measured bool
		key      string
	}{
		{"session call p50", true, true, "session-call"},
		{"jail: per-call p50, warm pool", false, true, "percall"},
		{"jail: per-call p50, back to back", false, false, "percall-b2b"},
		{"jail: CPU per per-call run, vs bwrap", true, true, "cpu-call-2"}, // at the best level
		{"jail: CPU per per-call run, vs a fork", false, true, "cpu-call-2"},
		{"jail: per-call throughput, best level", false, true, "throughput-2"},
		{"jail: throughput at most clients, vs bwrap", true, true, "throughput-2"},
		{"jail: private memory per idle pooled box", true, true, "private-pooled"},
		{"cold kiln mcp start to first result", false, false, "coldstart"},
	} {
		tg, ok := got[c.name]
		if !ok {
			t.Errorf("no target %q", c.name)
			continue
		}
		measured := tg.Got != "not measured"
		if tg.Met != c.met || measured != c.measured || tg.Key != c.key {
			t.Errorf("%s: met %v measured %v key %q, want %v %v %q (%+v)", c.name, tg.Met, measured, tg.Key, c.met, c.measured, c.key, tg)
		}
	}
	if _, ok := got["gVisor: CPU per per-call run"]; ok {
		t.Error("a jail run checks gVisor's targets")
	}
	if tg := got["session call p50"]; tg.Limit != 1.3*0.5 || tg.Base != "pipe" || !strings.Contains(tg.Want, "pipe") {
		t.Errorf("session call target %+v, want a limit of 1.3× the pipe's 0.5 ms", tg)
	}
}

// The test binary is built without the bench-only tag.
func TestHasBenchKnobs(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ok, err := hasBenchKnobs(exe)
	if err != nil {
		t.Fatal(err)
	}
	if ok {
		t.Errorf("%s: says it was built with -tags %s", exe, BenchKnobsTag)
	}
	if _, err := hasBenchKnobs("/dev/null"); err == nil {
		t.Error("a file that is no Go binary has build info")
	}
}

func TestPreloadsNone(t *testing.T) {
	for _, c := range []struct {
		args []string
		want bool
	}{
		{nil, false},
		{[]string{"--preload", "numpy"}, false},
		{[]string{"--preload", ""}, true},
		{[]string{"--preload="}, true},
		{[]string{"-preload=", "--preload=json"}, false}, // the last one counts
	} {
		if got := preloadsNone(c.args); got != c.want {
			t.Errorf("preloadsNone(%q) = %v, want %v", c.args, got, c.want)
		}
	}
}

// A CPU target not met on a busy machine names the machine-wide figure
// and the figure with every hardening measure off.
func TestTargetBounds(t *testing.T) {
	rep := &Report{Backend: "jail", IdleBusy: 0.9, Measurements: []Measurement{
		{Key: "throughput-2", Unit: "calls/s", N: 100, P50: 50},
		{Key: "cpu-call-2", Unit: "ms CPU", N: 100, P50: 40, CgroupCPU: 40, MachineCPU: 200},
		{Key: "cpu-bwrap", Unit: "ms CPU", N: 50, P50: 20},
		{Key: "hardening-all-off-cpu", Unit: "ms CPU", N: 50, P50: 33, CgroupCPU: 33, MachineCPU: 150},
	}}
	for _, tg := range rep.checkTargets() {
		if tg.Key != "cpu-call-2" || tg.Base != "cpu-bwrap" {
			continue
		}
		if tg.Met || !strings.Contains(tg.Bound, "machine-wide 200.0 ms, the machine 90% busy") || !strings.Contains(tg.Bound, "off: 33.0 ms") {
			t.Errorf("CPU target %+v: want not met, bounded by the cgroup figure and the all-off row", tg)
		}
		return
	}
	t.Fatal("no CPU target")
}

// The jail's box lines, as its text handler writes them, count by path;
// other lines count nothing.
func TestBoxCounts(t *testing.T) {
	var b strings.Builder
	log := slog.New(slog.NewTextHandler(&b, &slog.HandlerOptions{Level: slog.LevelDebug}))
	log.Debug("forked a box", "id", "a", "one_step", true, "path", "one-step", "cgroup", time.Millisecond)
	log.Debug("forked a box", "id", "b", "one_step", false, "path", "two-step")
	log.Debug("started a box", "id", "c", "path", "direct")
	log.Debug("forked a box", "id", "d", "path", "one-step")
	log.Debug("forked a box", "id", "e", "one_step", true)             // an older kiln's
	log.Info("call", "duration", time.Millisecond, "path", "one-step") // not a box
	total := &boxCounts{}
	c := &boxCounts{total: total}
	before := c.snapshot()
	for _, line := range strings.Split(b.String(), "\n") {
		c.line(line)
	}
	want := map[string]int{"one-step": 3, "two-step": 1, "direct": 1}
	if got := c.since(before); !maps.Equal(got, want) {
		t.Errorf("counted %v, want %v", got, want)
	}
	if got := total.snapshot(); !maps.Equal(got, want) {
		t.Errorf("the run's total counted %v, want %v", got, want)
	}
	if got := describeBoxes(want); got != "3 one-step, 1 direct, 1 two-step" {
		t.Errorf("describeBoxes = %q", got)
	}
}

func TestServerPreload(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, strings.Join(sandbox.DefaultPreload, ",")},
		{[]string{"--preload", "numpy"}, "numpy"},
		{[]string{"--preload="}, ""},
		{[]string{"-preload=json", "--preload", "csv"}, "csv"},
	} {
		if got := serverPreload(c.args); got != c.want {
			t.Errorf("serverPreload(%q) = %q, want %q", c.args, got, c.want)
		}
	}
}

// The fork baseline forks a python with the servers' preloads and reads
// an idle child's private memory; a missing bwrap gives a row that says
// so, not an error.
func TestForkAndBwrapBaselines(t *testing.T) {
	py := "/usr/bin/python3"
	if _, err := os.Stat(py); err != nil {
		t.Skip("no /usr/bin/python3")
	}
	r := &runner{opts: Options{Python: py, Bwrap: "kiln-no-such-bwrap", Iterations: 5, ServerArgs: []string{"--preload", "json"}}, rep: &Report{}}
	if err := r.fork(context.Background()); err != nil {
		t.Fatal(err)
	}
	if m := r.rep.get("fork"); m == nil || m.N != 5 || m.P50 <= 0 {
		t.Errorf("fork row %+v, want 5 samples", m)
	}
	if m := r.rep.get("private-fork"); m == nil || m.P50 <= 0 || m.P50 > 64 {
		t.Errorf("private-fork row %+v, want a forked child's few MiB", m)
	}
	if err := r.bwrap(context.Background()); err != nil {
		t.Fatal(err)
	}
	if m := r.rep.get("spawn-bwrap"); m == nil || !strings.Contains(m.Err, "skipped: no kiln-no-such-bwrap in $PATH") {
		t.Errorf("bwrap row %+v, want a line saying it is not installed", m)
	}
}

// A process that is no box's PID 1 is named by its command alone.
func TestProcessRole(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("no /proc")
	}
	want := "bench.test"
	if b, err := os.ReadFile("/proc/self/comm"); err == nil {
		want = strings.TrimSpace(string(b))
	}
	if os.Getpid() == 1 {
		want += " (PID 1)"
	}
	if got := processRole(os.Getpid()); got != want {
		t.Errorf("processRole(self) = %q, want %q", got, want)
	}
}

// The Jupyter baseline runs cells in a real ipykernel where the host has
// one, and says which packages it needs where it has none: a python
// without jupyter_client gives a row that says so, not an error.
func TestJupyterBaseline(t *testing.T) {
	py := "/usr/bin/python3"
	if _, err := os.Stat(py); err != nil {
		t.Skip("no /usr/bin/python3")
	}
	ctx := context.Background()
	missing := &runner{opts: Options{Python: "/bin/false"}, rep: &Report{}}
	if err := missing.jupyter(ctx); err != nil {
		t.Fatal(err)
	}
	if m := missing.rep.get("jupyter-call"); m == nil || !strings.Contains(m.Err, "python3-ipykernel") {
		t.Errorf("jupyter row %+v with no jupyter_client, want a line naming the packages", m)
	}
	if why := jupyterMissing(ctx, py); why != "" {
		t.Skipf("%s (make deps-test installs them)", why)
	}
	r := &runner{opts: Options{Python: py, Iterations: 5, ServerArgs: []string{"--preload", "json"}}, rep: &Report{}}
	if err := r.jupyter(ctx); err != nil {
		t.Fatal(err)
	}
	if m := r.rep.get("jupyter-call"); m == nil || m.Err != "" || m.N != 5 || m.P50 <= 0 {
		t.Errorf("jupyter row %+v, want 5 cells", m)
	}
	for _, k := range []string{"pss-jupyter", "private-jupyter"} {
		if m := r.rep.get(k); m == nil || m.P50 < 5 || m.P50 > 1024 {
			t.Errorf("%s row %+v, want a python kernel's tens of MiB", k, m)
		}
	}
}

// The server's per-call log line gives the server's share of a call; a
// box's line and a line without a duration give none.
func TestCallDurationsFromLog(t *testing.T) {
	var c boxCounts
	for _, l := range []string{
		`time=2026-12-03T07:05:43.275Z level=INFO msg=call principal=local tool=run_python session=bench duration=1.618547ms run=1.197289ms error=false`,
		`time=2026-12-03T07:05:43.281Z level=DEBUG msg="forked a box" id=ab path=one-step`,
		`time=2026-12-03T07:05:43.290Z level=INFO msg=call principal=local tool=run_python session=bench duration=2.5s run=2s error=false`,
		`time=2026-12-03T07:05:43.291Z level=INFO msg=call principal=local tool=run_python session=bench error=true`,
		`time=2026-12-03T07:05:43.295Z level=INFO msg=call principal=local tool=run_python session=bench duration=830µs run=700µs`,
	} {
		c.line(l)
	}
	want := []time.Duration{1618547 * time.Nanosecond, 2500 * time.Millisecond, 830 * time.Microsecond}
	if got := c.callsSince(0); !slices.Equal(got, want) {
		t.Errorf("calls %v, want %v", got, want)
	}
	if got := c.callsSince(2); !slices.Equal(got, want[2:]) {
		t.Errorf("callsSince(2) = %v, want %v", got, want[2:])
	}
	if got := c.snapshot(); got["one-step"] != 1 {
		t.Errorf("boxes %v, want the forked box counted", got)
	}
}

// TestClusterTargets: the cluster's pool hit against the jail's row of the
// same run, and the throughput through the most nodes against one node.
func TestClusterTargets(t *testing.T) {
	rep := &Report{Backend: "cluster", Measurements: []Measurement{
		{Key: "percall", Unit: "ms", N: 20, P50: 30},
		{Key: jailPrefix + "percall", Unit: "ms", N: 20, P50: 20}, // 1.5×: met
		{Key: "nodes-throughput-1", Unit: "calls/s", N: 100, P50: 10},
		{Key: "nodes-throughput-2", Unit: "calls/s", N: 100, P50: 18},
		{Key: "nodes-throughput-3", Unit: "calls/s", N: 100, P50: 14}, // the most nodes: 1.4×, not met
	}}
	got := map[string]Target{}
	for _, tg := range rep.checkTargets() {
		got[tg.Name] = tg
	}
	if tg := got["cluster: per-call p50 on a pool hit, vs the jail's"]; !tg.Met || tg.Key != "percall" {
		t.Errorf("pool hit: %+v", tg)
	}
	tg := got["cluster: throughput with all nodes, vs one"]
	if tg.Met || tg.Key != "nodes-throughput-3" || tg.Value != 14 || !strings.Contains(tg.Bound, "share this host's CPUs") {
		t.Errorf("throughput by nodes: %+v", tg)
	}
	if _, ok := got["jail: per-call p50, warm pool"]; ok {
		t.Error("a jail target checked on a cluster run")
	}
}

// TestPairAlongside: each row of a backend measured alongside (the jail,
// kubernetes) follows the row of the same key, jail first, and one with
// no such row comes last.
func TestPairAlongside(t *testing.T) {
	r := &runner{opts: Options{Alongside: []Alongside{{Backend: "kubernetes"}}}, rep: &Report{}}
	for _, k := range []string{"session", "percall", "throughput-4",
		"jail:session", "jail:percall", "kubernetes:k8s-create-hit", "kubernetes:session", "kubernetes:percall"} {
		r.add(Measurement{Key: k})
	}
	r.pairJail()
	var got []string
	for _, m := range r.rep.Measurements {
		got = append(got, m.Key)
	}
	want := []string{"session", "jail:session", "kubernetes:session", "percall", "jail:percall", "kubernetes:percall",
		"throughput-4", "kubernetes:k8s-create-hit"}
	if !slices.Equal(got, want) {
		t.Errorf("rows in the order\n%v\nwant\n%v", got, want)
	}
}
