package bench

import (
	"fmt"
	"slices"
	"strings"
)

// The targets of issues 18, 28 and 29, each checked against this run.
// Relative ones are a factor of a baseline measured in the same run (the
// python3 spawn, bubblewrap, a fork of the same template, the bare pipe,
// a Jupyter kernel), so a busy or slow machine moves both sides.
type targetSpec struct {
	backend string // "" for every backend
	name    string
	key     string  // the measurement checked; "best-throughput", "cpu-best" pick a level, "top-throughput" is the highest one
	atMost  bool    // true: value ≤ limit; false: value ≥ limit
	limit   float64 // absolute limit, or factor of base
	base    string  // "" for an absolute limit
	unit    string
}

var targetTable = []targetSpec{
	{backend: "jail", name: "jail: CPU per per-call run, vs bwrap", key: "cpu-best", atMost: true, limit: 0.8, base: "cpu-bwrap", unit: "ms"},
	{backend: "jail", name: "jail: CPU per per-call run, vs a fork", key: "cpu-best", atMost: true, limit: 2, base: "cpu-fork", unit: "ms"},
	{backend: "jail", name: "jail: per-call throughput, best level", key: "best-throughput", limit: 200, unit: "calls/s"},
	{backend: "jail", name: "jail: throughput at most clients, vs bwrap", key: "top-throughput", limit: 2, base: "top-bwrap-throughput", unit: "calls/s"},
	{backend: "jail", name: "jail: per-call p50, warm pool", key: "percall", atMost: true, limit: 0.2, base: "spawn", unit: "ms"},
	{backend: "jail", name: "jail: per-call p50, back to back", key: "percall-b2b", atMost: true, limit: 0.3, base: "spawn", unit: "ms"},
	{name: "session call p50", key: "session-call", atMost: true, limit: 1.3, base: "pipe", unit: "ms"},
	{name: "session call p50, vs a Jupyter kernel", key: "session-call", atMost: true, limit: 0.2, base: "jupyter-call", unit: "ms"},
	{backend: "jail", name: "jail: private memory per idle pooled box", key: "private-pooled", atMost: true, limit: 2, unit: "MiB"},
	{backend: "gvisor", name: "gVisor: CPU per per-call run", key: "cpu-best", atMost: true, limit: 80, unit: "ms"},
	{backend: "gvisor", name: "gVisor: CPU per per-call run, vs runsc do", key: "cpu-best", atMost: true, limit: 0.5, base: "cpu-native", unit: "ms"},
	{backend: "gvisor", name: "gVisor: per-call throughput, best level", key: "best-throughput", limit: 20, unit: "calls/s"},
	{backend: "gvisor", name: "gVisor: PSS per idle restored box", key: "pss-pooled", atMost: true, limit: 100, unit: "MiB"},
	{name: "cold kiln mcp start to first result", key: "coldstart", atMost: true, limit: 350, unit: "ms"},
	{backend: "cluster", name: "cluster: per-call p50 on a pool hit, vs the jail's", key: "percall", atMost: true, limit: 2, base: "jail:percall", unit: "ms"},
	{backend: "cluster", name: "cluster: throughput with all nodes, vs one", key: "nodes-throughput-top", limit: 1.5, base: "nodes-throughput-1", unit: "calls/s"},
	{backend: "microvm", name: "microVM: PSS per idle clone", key: "pss-pooled", atMost: true, limit: 40, unit: "MiB"},
}

// value returns a measurement's p50, or for the derived keys the best
// throughput level and the CPU per call at that level.
func (r *Report) value(key string) (v float64, from string, ok bool) {
	switch key {
	case "best-throughput", "cpu-best":
		best := -1.0
		for _, m := range r.Measurements {
			if strings.HasPrefix(m.Key, "throughput-") && !strings.HasPrefix(m.Key, "throughput-bwrap-") && m.Err == "" && m.P50 > best {
				best, from = m.P50, m.Key
			}
		}
		if best < 0 {
			return 0, "", false
		}
		if key == "best-throughput" {
			return best, from, true
		}
		from = "cpu-call-" + strings.TrimPrefix(from, "throughput-")
	case "top-throughput", "top-bwrap-throughput":
		// The highest client level kiln was measured at, for kiln and
		// for bubblewrap alike.
		top := -1
		for _, m := range r.Measurements {
			var n int
			if _, err := fmt.Sscanf(m.Key, "throughput-%d", &n); err == nil && m.Err == "" && n > top {
				top = n
			}
		}
		if top < 0 {
			return 0, "", false
		}
		from = fmt.Sprintf("throughput-%d", top)
		if key == "top-bwrap-throughput" {
			from = fmt.Sprintf("throughput-bwrap-%d", top)
		}
	case "nodes-throughput-top":
		// The throughput through the most nodes measured.
		top := 0
		for _, m := range r.Measurements {
			var n int
			if _, err := fmt.Sscanf(m.Key, "nodes-throughput-%d", &n); err == nil && m.Err == "" && n > top {
				top = n
			}
		}
		if top == 0 {
			return 0, "", false
		}
		from = fmt.Sprintf("nodes-throughput-%d", top)
	default:
		from = key
	}
	m := r.get(from)
	if m == nil || m.Err != "" || m.N == 0 {
		return 0, from, false
	}
	return m.P50, from, true
}

func (r *runner) targets() { r.rep.Targets = r.rep.checkTargets() }

func (r *Report) checkTargets() []Target {
	var out []Target
	for _, ts := range targetTable {
		if ts.backend != "" && ts.backend != r.Backend {
			continue
		}
		t := Target{Name: ts.name, Unit: ts.unit}
		op := "≥"
		if ts.atMost {
			op = "≤"
		}
		limit := ts.limit
		baseOK := true
		if ts.base != "" {
			b, _, ok := r.value(ts.base)
			t.Base, t.Factor = ts.base, ts.limit
			limit, baseOK = ts.limit*b, ok && b > 0
			t.Want = fmt.Sprintf("%s %g× %s (%s %s)", op, ts.limit, ts.base, num(limit), ts.unit)
		} else {
			t.Want = fmt.Sprintf("%s %g %s", op, ts.limit, ts.unit)
		}
		v, from, ok := r.value(ts.key)
		t.Key = from
		if !ok || !baseOK {
			t.Got = "not measured"
			out = append(out, t)
			continue
		}
		t.Value, t.Limit = v, limit
		t.Got = fmt.Sprintf("%s %s", num(v), ts.unit)
		if ts.base != "" {
			t.Got += fmt.Sprintf(" (%.2f×)", v/(limit/ts.limit))
		}
		if ts.atMost {
			t.Met = v <= limit
		} else {
			t.Met = v >= limit
		}
		if !t.Met {
			t.Bound = bounds[ts.key]
		}
		if !t.Met {
			t.Bound = strings.Join(slices.DeleteFunc([]string{t.Bound, r.boundOf(ts.key, from)}, func(s string) bool { return s == "" }), "; ")
		}
		out = append(out, t)
	}
	return out
}

// bounds say, for a target not met, which measurement of this run shows
// what holds it back.
var bounds = map[string]string{
	"cpu-best":        "see the hardening rows (CPU per run with each measure off) and cpu-spawn",
	"best-throughput": "CPU per run: 2 CPUs / CPU per run caps it",
	"top-throughput":  "CPU per run: the CPUs / CPU per run caps it",
	"private-pooled":  "what a box's processes write: the kernel's and PID 1's copies of the template's pages",
	"percall":         "see the hardening rows",
	"percall-b2b":     "box creation: the pool runs dry",
	"session-call":    "kiln's protocol path against the floor",
	"coldstart":       "the server's start plus a plain box's (compare spawn)",
	// The bench's nodes run on its own host: more of them add no CPUs.
	"nodes-throughput-top": "the nodes share this host's CPUs: CPU per run (nodes-cpu-call rows) caps it; nodes on their own hosts add theirs",
}

// boundOf adds what this run measured about a target not met: the
// machine-wide figure, and the same figure with the jail's hardening
// measures all off.
func (r *Report) boundOf(key, from string) string {
	var out []string
	switch key {
	case "cpu-best":
		if m := r.get(from); m != nil && m.MachineCPU > 0 {
			s := fmt.Sprintf("machine-wide %s ms", num(m.MachineCPU))
			if r.IdleBusy > busyMachine {
				s += fmt.Sprintf(", the machine %.0f%% busy without kiln", 100*r.IdleBusy)
			}
			out = append(out, s)
		}
		if m := r.get("hardening-all-off-cpu"); m != nil && m.Err == "" && m.N > 0 {
			out = append(out, fmt.Sprintf("all four hardening measures off: %s ms", num(m.P50)))
		}
	case "session-call":
		if m := r.get("session-call-server"); m != nil && m.Err == "" && m.N > 0 {
			out = append(out, fmt.Sprintf("%s ms of it in the server, the rest in the MCP client and stdio", num(m.P50)))
		}
	case "percall":
		if m := r.get("hardening-all-off"); m != nil && m.Err == "" && m.N > 0 {
			out = append(out, fmt.Sprintf("all four hardening measures off: %s ms", num(m.P50)))
		}
	}
	return strings.Join(out, "; ")
}
