package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Machine-wide CPU time. The bench's cgroup (cpuGroup) misses whatever a
// backend moves out of it: the jail's boxes under cgroup v2, runsc's
// sandbox and gofer processes. /proc/stat counts every CPU of the machine
// whoever runs on it, so the machine-wide figure holds everything kiln
// costs, plus the bench's own client and whatever else runs; the idle
// baseline, taken over an equal interval just before, says how much the
// rest is.

// clockTick is USER_HZ, the unit of /proc/stat: 100 on every Linux
// architecture kiln builds for (it is part of the kernel's ABI, unlike
// HZ).
const clockTick = 10 * time.Millisecond

// parseProcStat returns the busy time of the machine from /proc/stat's
// aggregate "cpu" line: user, nice, system, irq, softirq and steal (guest
// time is already inside user and nice; idle and iowait are not busy).
func parseProcStat(b []byte) (time.Duration, error) {
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != "cpu" {
			continue
		}
		if len(f) < 9 {
			return 0, fmt.Errorf("short cpu line in /proc/stat: %q", line)
		}
		var busy int64
		for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system (idle iowait) irq softirq steal
			n, err := strconv.ParseInt(f[i], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parsing /proc/stat: %w", err)
			}
			busy += n
		}
		return time.Duration(busy) * clockTick, nil
	}
	return 0, errors.New("no cpu line in /proc/stat")
}

// cpuWindow is a stretch of time over which the machine's busy time and
// the CPU time of the bench's cgroup and of the backend's own groups
// (Traits.CPUGroups) are all counted.
type cpuWindow struct {
	r             *runner
	start         time.Time
	busy0         time.Duration
	busyErr       error
	group0, self0 time.Duration
	groups        []string // the backend's groups counted besides the bench's
	backend0      time.Duration
}

// cpuStart opens a window; srv, if set, is the server whose backend's
// groups count too.
func (r *runner) cpuStart(srv *server) *cpuWindow {
	w := &cpuWindow{r: r}
	if srv != nil && r.cpu != nil {
		w.groups = r.backendGroups(srv.pid())
		w.backend0 = r.cpu.groupsUsage(w.groups)
	}
	w.group0, w.self0 = r.cpuUsage()
	w.busy0, w.busyErr = machineBusy()
	w.start = time.Now()
	return w
}

// backendGroups are the backend's CPU groups for the server with pid.
func (r *runner) backendGroups(pid int) []string {
	out := make([]string, 0, len(r.opts.Traits.CPUGroups))
	for _, g := range r.opts.Traits.CPUGroups {
		out = append(out, strings.ReplaceAll(g, "{pid}", strconv.Itoa(pid)))
	}
	return out
}

// cpuSpan is what a window measured.
type cpuSpan struct {
	Elapsed time.Duration
	// Machine is the machine-wide busy time (0 with MachineErr set).
	Machine    time.Duration
	MachineErr error
	// Group is the CPU time of the bench's cgroup minus the bench's own,
	// plus that of the backend's groups (0 when no group could be made).
	Group    time.Duration
	HasGroup bool
}

func (w *cpuWindow) stop() cpuSpan {
	busy1, err := machineBusy()
	s := cpuSpan{Elapsed: time.Since(w.start), MachineErr: w.busyErr}
	if s.MachineErr == nil {
		s.MachineErr = err
	}
	if s.MachineErr == nil {
		s.Machine = busy1 - w.busy0
	}
	if w.r.cpu != nil {
		g1, self1 := w.r.cpuUsage()
		s.Group, s.HasGroup = (g1-w.group0)-(self1-w.self0), true
		if len(w.groups) > 0 {
			s.Group += w.r.cpu.groupsUsage(w.groups) - w.backend0
		}
	}
	return s
}

// busyMachine is the share of CPU busy without kiln above which the
// machine-wide figures carry a warning.
const busyMachine = 0.05

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// cpuRow adds the CPU time of span per one of n operations: the cgroup
// figure (the bench's group and the backend's own: what kiln, its boxes
// and its helpers spent) as the headline, the machine-wide figure beside
// it; the machine-wide one alone where no group could be made.
func (r *runner) cpuRow(key, name string, span cpuSpan, n int, note string) {
	if n <= 0 {
		return
	}
	m := Measurement{Key: key, Name: name, Unit: "ms CPU", N: n, Note: note}
	if span.MachineErr == nil {
		m.MachineCPU = ms(span.Machine) / float64(n)
	}
	switch {
	case span.HasGroup:
		m.P50 = ms(span.Group) / float64(n)
		m.CgroupCPU = m.P50
		m.Note += "; cgroup figure"
		if span.MachineErr == nil {
			m.Note += fmt.Sprintf(" (machine-wide %.1f ms)", m.MachineCPU)
		}
	case span.MachineErr != nil:
		m.Err = fmt.Sprintf("reading machine-wide CPU time: %v", span.MachineErr)
	default:
		m.P50 = m.MachineCPU
		m.Note += "; machine-wide (no cgroup could be made)"
	}
	m.P99 = m.P50
	r.add(m)
}

// Waiting for quiet before an idle baseline: at most quietFor, in windows
// of quietWindow.
const (
	quietFor    = 90 * time.Second
	quietWindow = time.Second
)

// quiet waits, before an idle baseline, until a window of quietWindow
// finds the machine less than busyMachine busy, or quietFor has passed: a
// server that has just started may still be filling its pool (a Pod per
// box takes seconds each), and a baseline taken then counts its work as
// idle. Where the machine never goes quiet, the baseline's row warns.
func (r *runner) quiet(ctx context.Context) error {
	deadline := time.Now().Add(quietFor)
	for said := false; ; {
		w := r.cpuStart(nil)
		if err := sleep(ctx, quietWindow); err != nil {
			return err
		}
		span := w.stop()
		if span.MachineErr != nil {
			return nil
		}
		busy := r.busyShare(span)
		if busy < busyMachine || time.Now().After(deadline) {
			return nil
		}
		if !said {
			r.progress("  waiting for the machine to go quiet before the idle baseline (%.0f%% busy)", 100*busy)
			said = true
		}
	}
}

// busyShare is the share of all CPUs that span found busy machine-wide.
func (r *runner) busyShare(span cpuSpan) float64 {
	return span.Machine.Seconds() / (span.Elapsed.Seconds() * float64(r.rep.CPUs))
}
