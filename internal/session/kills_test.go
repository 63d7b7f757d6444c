package session_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// The in-process boxes enforce no limit; these tests raise the counters a
// backend's cgroup keeps (sessiontest.Backend.HitLimits) while a call runs
// and check what the result says. The jail's tests hit the real limits.

var smallLimits = sandbox.Limits{MemoryBytes: 64 << 20, Pids: 32, WorkspaceBytes: 16 << 20, TmpBytes: 8 << 20}

// gatedCell is python that creates started, waits for go, then runs then.
func gatedCell(t *testing.T, then string) (code, started string, release func()) {
	dir := t.TempDir()
	started, gate := filepath.Join(dir, "started"), filepath.Join(dir, "go")
	code = fmt.Sprintf("import os, time\nopen(%q, 'w').close()\nwhile not os.path.exists(%q): time.sleep(0.02)\n%s", started, gate, then)
	return code, started, func() { os.WriteFile(gate, nil, 0o644) }
}

func exists(p string) func() bool {
	return func() bool { _, err := os.Stat(p); return err == nil }
}

// TestKillOOMKernel: the memory limit kills the python kernel during a
// cell; the result names the limit and says the variables are gone and
// the workspace files kept, which the next calls confirm.
func TestKillOOMKernel(t *testing.T) {
	mgr, b := withPython(t, session.Options{Limits: smallLimits})
	s := getSession(t, mgr, "oom")
	ctx := context.Background()
	if _, err := s.RunPython(ctx, "kept = 1\nopen('kept.txt', 'w').write('x')", liveness); err != nil {
		t.Fatal(err)
	}
	code, started, release := gatedCell(t, "import signal; os.kill(os.getpid(), signal.SIGKILL)")
	ran := make(chan *session.Outcome, 1)
	go func() {
		out, err := s.RunPython(ctx, code, liveness)
		if err != nil {
			t.Error(err)
		}
		ran <- out
	}()
	waitUntil(t, exists(started), "the cell to start")
	b.HitLimits(1, 0)
	release()
	out := <-ran
	if out == nil || out.Error == nil || out.Error.Name != "KernelDied" ||
		!strings.Contains(out.Error.Value, "the sandbox ran out of memory (limit 64 MiB)") ||
		!strings.Contains(out.Note, "the sandbox ran out of memory (limit 64 MiB)") ||
		!strings.Contains(out.Note, "variables and imports are gone; files in the workspace are kept") || out.Restarted {
		t.Fatalf("a cell killed by the memory limit: %+v %+v", out, out.Error)
	}
	out, err := s.RunPython(ctx, "('kept' in dir(), open('kept.txt').read())", liveness)
	if err != nil || out.Result["text/plain"] != "(False, 'x')" {
		t.Errorf("after the kill: %v %+v", err, out)
	}
}

// TestKillNotOOM: a kernel that dies of something else (os._exit) is not
// blamed on the memory limit.
func TestKillNotOOM(t *testing.T) {
	mgr, _ := withPython(t, session.Options{Limits: smallLimits})
	s := getSession(t, mgr, "exit")
	out, err := s.RunPython(context.Background(), "import os; os._exit(3)", liveness)
	if err != nil || out.Error == nil || out.Error.Name != "KernelDied" || strings.Contains(out.Error.Value+out.Note, "memory") ||
		!strings.Contains(out.Note, "files in the workspace are kept") {
		t.Errorf("a kernel that exited: %v %+v %+v", err, out, out.Error)
	}
}

// TestKillOOMBox: a box that dies whole at its memory limit during a call
// (gVisor's way) gives a SandboxDied result naming the limit, and says
// the workspace is gone with it.
func TestKillOOMBox(t *testing.T) {
	mgr, b := withPython(t, session.Options{Limits: smallLimits})
	s := getSession(t, mgr, "oombox")
	ctx := context.Background()
	hold, release := holdCmd(t)
	defer release()
	started := filepath.Join(t.TempDir(), "started")
	ran := make(chan *session.Outcome, 1)
	go func() {
		out, err := s.RunShell(ctx, "touch "+started+"; "+hold, liveness)
		if err != nil {
			t.Error(err)
		}
		ran <- out
	}()
	waitUntil(t, exists(started), "the call to run")
	b.HitLimits(1, 0)
	b.Kill()
	out := <-ran
	if out == nil || !out.Restarted || out.Error == nil || out.Error.Name != "SandboxDied" ||
		!strings.Contains(out.Error.Value, "the sandbox ran out of memory (limit 64 MiB)") ||
		!strings.Contains(out.Note, "variables, imports and files in the workspace are gone") {
		t.Errorf("a box killed by its memory limit: %+v %+v", out, out.Error)
	}
}

// TestKillBetweenCalls: a box that died between calls is named in the next
// call's note, with the limit when its counters show one.
func TestKillBetweenCalls(t *testing.T) {
	mgr, b := withPython(t, session.Options{Limits: smallLimits})
	s := getSession(t, mgr, "between")
	ctx := context.Background()
	for _, c := range []struct {
		oom  int64
		want string
	}{
		{1, "the previous sandbox died between calls: the sandbox ran out of memory (limit 64 MiB)"},
		{0, "the previous sandbox died between calls: the sandbox died (a crash, or a limit this backend does not report)"},
	} {
		if _, err := s.RunShell(ctx, "true", liveness); err != nil {
			t.Fatal(err)
		}
		b.HitLimits(c.oom, 0)
		b.Kill()
		waitUntil(t, func() bool { return b.Live() == 0 }, "the killed box to be gone")
		out, err := s.RunShell(ctx, "true", liveness)
		if err != nil || !out.Fresh || !strings.Contains(out.Note, c.want) || !strings.Contains(out.Note, "files in the workspace are gone") {
			t.Errorf("after a death between calls (oom %d): %v %+v", c.oom, err, out)
		}
	}
}

// TestKillPids: forks refused at the pids limit during a call are named,
// with the limit, and the session keeps its state.
func TestKillPids(t *testing.T) {
	mgr, b := withPython(t, session.Options{Limits: smallLimits})
	s := getSession(t, mgr, "pids")
	ctx := context.Background()
	code, started, release := gatedCell(t, "kept = 1")
	ran := make(chan *session.Outcome, 1)
	go func() {
		out, err := s.RunPython(ctx, code, liveness)
		if err != nil {
			t.Error(err)
		}
		ran <- out
	}()
	waitUntil(t, exists(started), "the cell to start")
	b.HitLimits(0, 3)
	release()
	out := <-ran
	if out == nil || !strings.Contains(out.Note, "the process limit (32) was reached: 3 process or thread starts were refused; the session's state is kept") {
		t.Errorf("a cell that hit the pids limit: %+v", out)
	}
	if out, err := s.RunShell(ctx, "true", liveness); err != nil || strings.Contains(out.Note, "process limit") {
		t.Errorf("the next call still blames the pids limit: %v %+v", err, out)
	}
}

// TestKillDiskFull: a write that fails with ENOSPC (here /dev/full, which
// returns it for real) gets a note naming the workspace's size.
func TestKillDiskFull(t *testing.T) {
	mgr, _ := withPython(t, session.Options{Limits: smallLimits})
	s := getSession(t, mgr, "disk")
	ctx := context.Background()
	const want = "the workspace is full (16 MiB): a write failed for lack of space; the session's state is kept"
	out, err := s.RunPython(ctx, "open('/dev/full', 'w').write('x' * 100000)", liveness)
	if err != nil || out.Error == nil || !strings.Contains(out.Note, want) {
		t.Errorf("python: %v %+v", err, out)
	}
	out, err = s.RunShell(ctx, "echo x > /dev/full", liveness)
	if err != nil || out.ExitCode == 0 || !strings.Contains(out.Note, want) {
		t.Errorf("shell: %v %+v", err, out)
	}
	if out, err := s.RunShell(ctx, "echo fine", liveness); err != nil || strings.Contains(out.Note, "full") {
		t.Errorf("a call that filled nothing: %v %+v", err, out)
	}
}

// TestKillTimePerCall: in per-call mode a timeout names its limit and does
// not talk of a session.
func TestKillTimePerCall(t *testing.T) {
	mgr, _ := withPython(t, session.Options{Mode: session.ModePerCall})
	out, _, err := mgr.RunOnce(context.Background(), session.Python, "while True: pass", nil, 1500*time.Millisecond)
	if err != nil || !out.TimedOut || out.Note != "the call ran past its time limit of 1.5s; it was interrupted" {
		t.Errorf("a per-call timeout: %v %+v", err, out)
	}
	out, _, err = mgr.RunOnce(context.Background(), session.Shell, "sleep 5", nil, time.Second)
	if err != nil || !out.TimedOut || !strings.HasPrefix(out.Note, "the call ran past its time limit of 1 s") || strings.Contains(out.Note, "session") {
		t.Errorf("a per-call timeout: %v %+v", err, out)
	}
}
