package jail_test

import (
	"context"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// forkLog records the backend's "forked a box" debug records and fails
// the test on every warning.
type forkLog struct {
	failOnWarn
	mu        sync.Mutex
	oneStep   []bool
	preloaded []string // what the last template that said it was ready imported
}

func (h *forkLog) Enabled(_ context.Context, l slog.Level) bool { return true }
func (h *forkLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		return h.failOnWarn.Handle(ctx, r)
	}
	if r.Message == "jail zygote ready" {
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "preloaded" {
				h.mu.Lock()
				h.preloaded, _ = a.Value.Any().([]string)
				h.mu.Unlock()
			}
			return true
		})
	}
	if r.Message == "forked a box" {
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "one_step" {
				h.mu.Lock()
				h.oneStep = append(h.oneStep, a.Value.Bool())
				h.mu.Unlock()
			}
			return true
		})
	}
	return nil
}
func (h *forkLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *forkLog) WithGroup(string) slog.Handler      { return h }

// TestZygoteOneStep checks that the template makes a box's PID 1 in one
// clone, with numpy (whose OpenBLAS starts threads) preloaded, and that a
// box made so is as confined as one made in two steps: its own cgroup
// namespace rooted at its group, its own user, pid, mount, network, ipc
// and uts namespaces, none of the template's uids, and BLAS still works.
func TestZygoteOneStep(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the jail tests need root (user namespaces with a uid range, cgroups)")
	}
	h := &forkLog{failOnWarn: failOnWarn{t}}
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Zygote: true, Logger: slog.New(h)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	self := func(ns string) string {
		p, err := os.Readlink("/proc/self/ns/" + ns)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, id := range []string{"one-a", "one-b"} {
		box, err := b.Create(ctx, sandbox.Spec{ID: id, Preload: []string{"numpy"}})
		if err != nil {
			t.Fatal(err)
		}
		res, err := box.RunShell(ctx, `cat /proc/self/cgroup; cat /proc/1/status | grep -E '^(Uid|Gid|NoNewPrivs|Seccomp|CapBnd):'; readlink /proc/self/ns/user /proc/self/ns/pid /proc/self/ns/mnt /proc/self/ns/net /proc/self/ns/ipc /proc/self/ns/uts /proc/self/ns/cgroup`, sandbox.ExecOptions{})
		if err != nil {
			t.Fatal(err)
		}
		out := res.Stdout.Text
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, "::") || strings.HasPrefix(line, "0:") || strings.Contains(line, ":memory:") || strings.Contains(line, ":pids:") {
				if !strings.HasSuffix(line, ":/") {
					t.Errorf("%s: the box's cgroup namespace is not rooted at its group: %q", id, line)
				}
			}
		}
		for _, want := range []string{"NoNewPrivs:\t1", "Seccomp:\t2", "CapBnd:\t0000000000000000", "Uid:\t0\t0\t0\t0"} {
			if !strings.Contains(out, want) {
				t.Errorf("%s: PID 1 lacks %q:\n%s", id, want, out)
			}
		}
		for _, ns := range []string{"user", "pid", "mnt", "net", "ipc", "uts", "cgroup"} {
			if strings.Contains(out, self(ns)) {
				t.Errorf("%s: the box shares the host's %s namespace:\n%s", id, ns, out)
			}
		}
		py, err := box.RunPython(ctx, "import numpy; float((numpy.ones((300, 300)) @ numpy.ones((300, 300)))[0, 0])", sandbox.ExecOptions{})
		if err != nil || py.Error != nil || py.Result["text/plain"] != "300.0" {
			t.Errorf("%s: BLAS in a cloned box: %v %+v", id, err, py)
		}
		box.Close()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.oneStep) != 2 {
		t.Fatalf("logged %d forks, want 2", len(h.oneStep))
	}
	for i, one := range h.oneStep {
		if !one {
			t.Errorf("box %d was made in two steps, not cloned in one", i)
		}
	}
}

// TestZygoteOneStepDefaultPreload checks that the template of the default
// preloads, as kiln's servers use them (sandbox.DefaultPreload), makes
// every box in one clone. pandas imports numexpr, whose thread pool a
// fork's at-fork handlers do not stop: a template that keeps it is not
// single-threaded and falls back to two steps, one more copy of the
// template per box.
func TestZygoteOneStepDefaultPreload(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the jail tests need root (user namespaces with a uid range, cgroups)")
	}
	h := &forkLog{failOnWarn: failOnWarn{t}}
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Zygote: true, Logger: slog.New(h)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, c := range []struct {
		id   string
		cpus float64
	}{{"default-a", 0}, {"default-b", 0}, {"default-2cpu", 2}} {
		id := c.id
		box, err := b.Create(ctx, sandbox.Spec{ID: id, Preload: sandbox.DefaultPreload, Limits: sandbox.Limits{CPUs: c.cpus}})
		if err != nil {
			t.Fatal(err)
		}
		h.mu.Lock()
		preloaded := slices.Clone(h.preloaded)
		h.mu.Unlock()
		if !slices.Equal(preloaded, sandbox.DefaultPreload) {
			box.Close()
			t.Skipf("the host's python imports only %v of the default preloads %v: install them (python3-numpy, python3-pandas, python3-matplotlib)", preloaded, sandbox.DefaultPreload)
		}
		// numexpr, quiesced in the template, still evaluates in the box.
		py, err := box.RunPython(ctx, "import numexpr, numpy; int(numexpr.evaluate('a * 2', {'a': numpy.arange(100000)}).sum())", sandbox.ExecOptions{})
		if err != nil || py.Error != nil || py.Result["text/plain"] != "9999900000" {
			t.Errorf("%s: numexpr in a cloned box: %v %+v", id, err, py)
		}
		// Its pool has as many threads as the box has CPUs (the host's
		// count at most, numexpr's own default): one by default.
		want := "1"
		if c.cpus > 1 {
			want = "min(2, os.cpu_count())"
		}
		py, err = box.RunPython(ctx, "import numexpr, os; numexpr.get_num_threads() == "+want, sandbox.ExecOptions{})
		if err != nil || py.Error != nil || py.Result["text/plain"] != "True" {
			t.Errorf("%s (%g CPUs): numexpr's threads are not %s: %v %+v", id, c.cpus, want, err, py)
		}
		box.Close()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.oneStep) != 3 {
		t.Fatalf("logged %d forks, want 3", len(h.oneStep))
	}
	for i, one := range h.oneStep {
		if !one {
			t.Errorf("box %d of the default template (%v) was made in two steps, not cloned in one: the template keeps threads", i, sandbox.DefaultPreload)
		}
	}
	// kiln doctor says so: the backend's notes name the path its last box took.
	if notes := strings.Join(b.Notes(), "\n"); !strings.Contains(notes, "one-step") || !strings.Contains(notes, strings.Join(sandbox.DefaultPreload, ",")) {
		t.Errorf("the backend's notes do not say its boxes are cloned in one step from the default template:\n%s", notes)
	}
}
