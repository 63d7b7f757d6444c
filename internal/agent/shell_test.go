package agent

import (
	"strings"
	"testing"
	"time"
)

// TestShellOutputSurvivesSlowReader: a command that has exited keeps every
// byte it wrote, however late the agent gets round to reading its pipes (on
// a loaded host the copy could be scheduled after exec's WaitDelay and the
// output came back empty with exit status 0).
func TestShellOutputSurvivesSlowReader(t *testing.T) {
	shellReadHook = func() { time.Sleep(3 * shellWaitDelay) }
	t.Cleanup(func() { shellReadHook = nil })
	a := New(Config{Workspace: t.TempDir(), UID: -1, GID: -1})
	res, err := a.runShell("echo out; sleep 0.1; echo more; echo err >&2", 1000, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Stdout.Text != "out\nmore\n" || res.Stderr.Text != "err\n" || res.ExitCode != 0 {
		t.Fatalf("stdout %q, stderr %q, exit %d; want out, err, 0", res.Stdout.Text, res.Stderr.Text, res.ExitCode)
	}
}

// TestShellBackgroundChildDoesNotHold: a command that leaves a child behind
// holding its output returns soon after it exits, with what it wrote.
func TestShellBackgroundChildDoesNotHold(t *testing.T) {
	a := New(Config{Workspace: t.TempDir(), UID: -1, GID: -1})
	start := time.Now()
	res, err := a.runShell("echo before; sleep 30 & echo after", 1000, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("the command waited %s for its background child", d)
	}
	if !strings.Contains(res.Stdout.Text, "before\n") || !strings.Contains(res.Stdout.Text, "after\n") {
		t.Fatalf("stdout %q", res.Stdout.Text)
	}
}
