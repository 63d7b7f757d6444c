package gvisor

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// Tests that start boxes need root and a static runsc. They use, in order:
// $KILN_RUNSC; the pinned runsc in kiln's cache; or, with
// KILN_TEST_GVISOR=1, the pinned runsc built by EnsureRunsc (about a
// minute with a warm module cache). The agent is $KILN_AGENT, or built from
// ./cmd/kiln-agent.

var (
	agentOnce sync.Once
	agentBin  string
	agentErr  error
)

func testRunsc(tb testing.TB) string {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("gvisor: needs root (runsc creates namespaces and cgroups)")
	}
	if p := os.Getenv("KILN_RUNSC"); p != "" {
		return p
	}
	if p, err := CachedRunscPath(); err == nil {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if os.Getenv("KILN_TEST_GVISOR") != "1" {
		tb.Skip("gvisor: no runsc (set KILN_RUNSC, or KILN_TEST_GVISOR=1 to build the pinned one, about a minute)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	p, err := EnsureRunsc(ctx, slog.New(slog.NewTextHandler(os.Stderr, nil)))
	if err != nil {
		tb.Fatalf("building runsc: %v", err)
	}
	return p
}

func testAgent(tb testing.TB) string {
	tb.Helper()
	if p := os.Getenv("KILN_AGENT"); p != "" {
		return p
	}
	agentOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kiln-agent-")
		if err != nil {
			agentErr = err
			return
		}
		agentBin = filepath.Join(dir, "kiln-agent")
		cmd := exec.Command("go", "build", "-o", agentBin, "kiln/cmd/kiln-agent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = &buildError{err, string(out)}
		}
	})
	if agentErr != nil {
		tb.Fatalf("building kiln-agent: %v", agentErr)
	}
	return agentBin
}

type buildError struct {
	err error
	out string
}

func (e *buildError) Error() string { return e.err.Error() + ": " + e.out }

func newTestBackend(tb testing.TB, opts Options) *Backend {
	tb.Helper()
	opts.Runsc = testRunsc(tb)
	if opts.Agent == "" {
		opts.Agent = testAgent(tb)
	}
	if opts.StateDir == "" {
		opts.StateDir = tb.TempDir()
	}
	if testing.Verbose() {
		opts.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	b, err := New(opts)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	tb.Cleanup(func() {
		if err := b.Close(); err != nil {
			tb.Errorf("Close: %v", err)
		}
		assertNothingLeft(tb, b)
	})
	return b
}

// assertNothingLeft checks that no box of b left a process, mount, cgroup
// or directory behind.
func assertNothingLeft(tb testing.TB, b *Backend) {
	tb.Helper()
	if _, err := os.Stat(b.dir); err == nil {
		tb.Errorf("state directory %s survives", b.dir)
	}
	if m, _ := boxkit.MountsUnder(b.dir); len(m) > 0 {
		tb.Errorf("mounts survive: %v", m)
	}
	// This process's box cgroups (other kiln processes may hold theirs).
	for _, d := range b.cgroups.Dirs(CgroupParent) {
		entries, _ := os.ReadDir(d)
		for _, e := range entries {
			if e.IsDir() && strings.HasPrefix(e.Name(), b.owner+".") {
				tb.Errorf("cgroup survives: %s/%s", d, e.Name())
			}
		}
	}
	out, _ := exec.Command("pgrep", "-f", b.dir).Output()
	if s := strings.TrimSpace(string(out)); s != "" {
		tb.Errorf("processes survive: %s", s)
	}
}

func run(tb testing.TB, sb sandbox.Sandbox, code string) string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := sb.RunPython(ctx, code, sandbox.ExecOptions{})
	if err != nil {
		tb.Fatalf("RunPython(%q): %v", code, err)
	}
	if res.Error != nil {
		tb.Fatalf("RunPython(%q): %s: %s\n%s", code, res.Error.Name, res.Error.Value, res.Error.Traceback)
	}
	out := res.Stdout.Text
	// Through JSON: the result's Go type is the agent's business.
	var result map[string]string
	if b, err := json.Marshal(res.Result); err == nil {
		json.Unmarshal(b, &result)
	}
	out += result["text/plain"]
	return out
}

func shell(tb testing.TB, sb sandbox.Sandbox, cmd string) *sandboxResult {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := sb.RunShell(ctx, cmd, sandbox.ExecOptions{})
	if err != nil {
		tb.Fatalf("RunShell(%q): %v", cmd, err)
	}
	return &sandboxResult{Out: res.Stdout.Text, Err: res.Stderr.Text, Code: res.ExitCode}
}

type sandboxResult struct {
	Out, Err string
	Code     int
}

func TestColdBox(t *testing.T) {
	b := newTestBackend(t, Options{Cold: true})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := b.Check(ctx); err != nil {
		t.Errorf("Check: %v", err)
	}
	if i := b.Info(); i.Version != RunscVersion && os.Getenv("KILN_RUNSC") == "" || i.Platform != "systrap" {
		t.Errorf("Info: %+v", i)
	}
	sb, err := b.Create(ctx, sandbox.Spec{ID: "test-cold"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if got := run(t, sb, "print(2+2)"); strings.TrimSpace(got) != "4" {
		t.Errorf("print(2+2) = %q", got)
	}
	if got, want := strings.TrimSpace(run(t, sb, "import sys; print(sys.version.split()[0])")), b.Runtime().Python; got != want {
		t.Errorf("python in the box is %q, Runtime says %q", got, want)
	}
	if out, _ := exec.Command("pgrep", "-f", b.dir).Output(); len(out) == 0 {
		t.Errorf("no host process of the box matches %s: the leftover check is blind", b.dir)
	}
	if !slices.ContainsFunc(b.cgroups.Children(CgroupParent), func(name string) bool { return strings.HasPrefix(name, b.owner+".") }) {
		t.Errorf("no cgroup of the box is named %s.*: the leftover check is blind", b.owner)
	}
	if l := b.Leftovers(); len(l) < 3 {
		t.Errorf("Leftovers with a box open: %q, want its cgroup, directory and processes", l)
	}
	r := shell(t, sb, "id; pwd; cat /proc/self/status | grep -i -E '^(cap|nonewpriv)'; ls /; cat /etc/passwd")
	t.Logf("%+v", r)
	sb.Close()
	if l := b.Leftovers(); len(l) > 0 {
		t.Errorf("Leftovers after Close: %q", l)
	}
}

// TestRestoredBoxesAreIndependent checks that boxes restored from one
// template do not share random state, files or each other's writes.
func TestRestoredBoxesAreIndependent(t *testing.T) {
	b := newTestBackend(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec := sandbox.Spec{Preload: []string{"numpy"}}
	if err := b.Warm(ctx, spec); err != nil {
		t.Fatalf("Warm: %v", err)
	}
	var outs []string
	for i := range 2 {
		spec.ID = "test-indep-" + string(rune('a'+i))
		sb, err := b.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		defer sb.Close()
		out := run(t, sb, "import random, os, numpy\nprint(random.random(), numpy.random.rand(), os.listdir('/work'))\nopen('/work/mine', 'w').write('x')")
		t.Logf("box %d: %s", i, out)
		outs = append(outs, out)
	}
	if outs[0] == outs[1] {
		t.Errorf("two restored boxes drew the same random numbers: %q", outs[0])
	}
	if strings.Contains(outs[1], "mine") {
		t.Errorf("the second box sees the first one's file: %q", outs[1])
	}
}

// TestTeardown checks that nothing outlives a box however it ends: a
// Create whose context ends before the hello, a box whose sandbox is killed
// on the host, and boxes still open when the backend closes (the cleanup of
// newTestBackend looks for processes, mounts, cgroups and directories).
func TestTeardown(t *testing.T) {
	b := newTestBackend(t, Options{Cold: true})
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	if _, err := b.Create(ctx, sandbox.Spec{ID: "test-late"}); err == nil {
		t.Error("Create with an expired context succeeded")
	}
	cancel()
	if n := len(b.boxes); n != 0 {
		t.Errorf("%d boxes left after a failed Create", n)
	}

	ctx, cancel = context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sb, err := b.Create(ctx, sandbox.Spec{ID: "test-killed"})
	if err != nil {
		t.Fatal(err)
	}
	// Code cannot kill the agent (another user); the host can kill the box.
	if r := shell(t, sb, "kill -9 1 2>&1; echo alive"); !strings.Contains(r.Out, "alive") {
		t.Fatalf("code killed the agent: %+v", r)
	}
	out, _ := exec.Command("pgrep", "-f", "runsc-sandbox .*"+b.dir).Output()
	if len(strings.Fields(string(out))) != 1 {
		t.Fatalf("want one sandbox process of %s, found %q", b.dir, out)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	syscall.Kill(pid, syscall.SIGKILL)
	select {
	case <-sb.Done():
	case <-ctx.Done():
		t.Fatal("the box did not end with its sandbox process")
	}
	if err := sb.Close(); err != nil {
		t.Errorf("Close of a dead box: %v", err)
	}
	for i := range 2 {
		if _, err := b.Create(ctx, sandbox.Spec{ID: "test-open-" + string(rune('a'+i))}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSweep: a new backend destroys the boxes of a kiln process that died.
func TestSweep(t *testing.T) {
	state := t.TempDir()
	// Pose as a process that is gone: the stamp matches no live process.
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	selfOwner = func() boxkit.Owner { return boxkit.Owner{PID: gone.Process.Pid, Start: 1} }
	dead := newTestBackend(t, Options{Cold: true, StateDir: state})
	selfOwner = boxkit.Self
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sb, err := dead.Create(ctx, sandbox.Spec{ID: "test-orphan"})
	if err != nil {
		t.Fatal(err)
	}
	fresh := newTestBackend(t, Options{Cold: true, StateDir: state})
	_ = fresh
	select {
	case <-sb.Done():
	case <-ctx.Done():
		t.Fatal("the orphaned box still runs after the sweep")
	}
	if _, err := os.Stat(dead.dir); err == nil {
		t.Errorf("the dead process's state survives the sweep")
	}
	if out, _ := exec.Command("pgrep", "-f", dead.dir).Output(); len(out) > 0 {
		t.Errorf("processes survive the sweep: %s", out)
	}
}
