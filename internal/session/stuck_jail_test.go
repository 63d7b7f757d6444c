//go:build linux

package session_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

// agentPids are the host pids of kiln-agent in this server's boxes: the
// agent binary as its box's PID 1 (code starts through the same binary,
// ExecCode, which is never PID 1).
func agentPids(agentBin string) []int {
	bin, err := os.Stat(agentBin)
	if err != nil {
		return nil
	}
	var out []int
	for _, pat := range []string{"/sys/fs/cgroup/pids/kiln/%d/*/cgroup.procs", "/sys/fs/cgroup/kiln/%d/*/cgroup.procs"} {
		groups, _ := filepath.Glob(fmt.Sprintf(pat, os.Getpid()))
		for _, g := range groups {
			b, _ := os.ReadFile(g)
			for _, f := range strings.Fields(string(b)) {
				pid, _ := strconv.Atoi(f)
				exe, err := os.Stat(fmt.Sprintf("/proc/%d/exe", pid))
				if err == nil && os.SameFile(exe, bin) && boxPID1(pid) {
					out = append(out, pid)
				}
			}
		}
	}
	return out
}

// boxPID1 reports whether pid is PID 1 of its own pid namespace: the
// last of its NSpid.
func boxPID1(pid int) bool {
	st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, line := range strings.Split(string(st), "\n") {
		if f := strings.Fields(line); len(f) > 2 && f[0] == "NSpid:" {
			return f[len(f)-1] == "1"
		}
	}
	return false
}

func stopped(pid int) bool {
	st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	i := bytes.LastIndexByte(st, ')')
	return i > 0 && len(st) > i+2 && (st[i+2] == 'T' || st[i+2] == 't')
}

// TestStuckAgentJail is the attack on a real jail: code in the box stops
// its own agent (SIGSTOP), so list_files hangs while it holds the session.
// reset_session must still return, the box must be destroyed without a
// word to its agent, and the hung call must end. Where code can no longer
// signal the agent, the test stops it from the host, by pid, so that it
// keeps testing the server's side.
func TestStuckAgentJail(t *testing.T) {
	b := jailBackend(t, false)
	mgr := session.NewManager(session.Options{Backend: b, PoolSize: 0, MaxBoxes: 2, DefaultTimeout: time.Minute})
	t.Cleanup(func() { finishes(t, "closing the manager", mgr.Close) })
	s, err := mgr.Get("attacker", "stuck")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	stop := `kill -STOP 1`
	out, err := s.RunShell(ctx, "setsid sh -c 'sleep 0.5; "+strings.ReplaceAll(stop, "'", `'\''`)+"' >/dev/null 2>&1 &", time.Minute)
	if err != nil {
		t.Fatalf("planting the stopper: %v %+v", err, out)
	}
	var agent int
	waitUntil(t, func() bool {
		p := agentPids(sandboxtest.BuildAgent(t))
		agent = 0
		if len(p) == 1 {
			agent = p[0]
		}
		return agent > 0
	}, "the box's agent to show up")
	deadline := time.Now().Add(5 * time.Second)
	for !stopped(agent) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if stopped(agent) {
		t.Logf("code in the box stopped its agent (pid %d on the host)", agent)
	} else {
		t.Logf("code in the box could not stop its agent; stopping pid %d from the host", agent)
		if err := syscall.Kill(agent, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, func() bool { return stopped(agent) }, "the agent to stop")
	}

	listed := make(chan error, 1)
	go func() {
		listed <- s.WithBox(ctx, func(box sandbox.Sandbox) error {
			_, err := box.ListFiles(ctx, "")
			return err
		})
	}()
	time.Sleep(300 * time.Millisecond) // let list_files reach the stopped agent
	finishes(t, "reset_session of a session whose agent is stopped", func() {
		if !mgr.Reset("attacker", "stuck") {
			t.Error("reset found no session")
		}
	})
	select {
	case err := <-listed:
		if err == nil {
			t.Error("list_files on a stopped agent succeeded")
		}
		t.Logf("the stuck list_files ended with: %v", err)
	case <-time.After(liveness):
		t.Fatal("list_files still hangs after reset_session")
	}
	waitUntil(t, func() bool { return len(b.Leftovers()) == 0 && mgr.LiveBoxes() == 0 }, "the stopped box to be destroyed")

	// The server still serves, in a fresh box.
	s, err = mgr.Get("attacker", "stuck")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := s.RunShell(ctx, "echo fresh", time.Minute); err != nil || out.Stdout.Text != "fresh\n" {
		t.Errorf("after reset: %v %+v", err, out)
	}
}
