package jail_test

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// TestKilnInAPidNamespace: a kiln in a pid namespace of its own over the
// host's cgroup tree (a privileged container on cgroup v1, a kiln node's
// DaemonSet Pod) cannot see the host's kilns. Its start-up sweep must not
// take their groups for a dead server's and kill their boxes, and its own
// group must not be another such kiln's (every container's kiln is pid
// 1). The control: this process's box answers before, and the nested
// kiln makes a box of its own with cgroups.
func TestKilnInAPidNamespace(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("a pid namespace over the host's cgroup tree needs root")
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("needs unshare (util-linux)")
	}
	b := newBackend(t)
	defer b.Close()
	if err := cgroupError(b); err != nil {
		t.Skipf("the host gives this kiln no cgroups: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), scaled(2*time.Minute))
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "host-box"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	if res, err := box.RunPython(ctx, "print(1)", sandbox.ExecOptions{}); err != nil || strings.TrimSpace(res.Stdout.Text) != "1" {
		t.Fatalf("control: the host kiln's box: %v %+v", err, res)
	}

	// Two at once, as two DaemonSets' Pods on one node: each is pid 1 of
	// its namespace. Each box holds 160 MiB of its 256 while the other
	// fills its own; sharing one group, one of them would be killed.
	sync := t.TempDir()
	helpers := make([]*exec.Cmd, 2)
	outs := make([]*strings.Builder, 2)
	for i := range helpers {
		cmd := exec.CommandContext(ctx, unshare, "--pid", "--fork", "--mount-proc", os.Args[0], "-test.run=^TestPidNamespaceHelper$", "-test.v")
		cmd.Env = append(os.Environ(), "KILN_TEST_PIDNS_HELPER="+sync, "KILN_TEST_PIDNS_INDEX="+strconv.Itoa(i))
		outs[i] = new(strings.Builder)
		cmd.Stdout, cmd.Stderr = outs[i], outs[i]
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		helpers[i] = cmd
	}
	for i, cmd := range helpers {
		err := cmd.Wait()
		t.Logf("nested kiln %d:\n%s", i, outs[i])
		if err != nil || !strings.Contains(outs[i].String(), "nested kiln's box ran") {
			t.Errorf("nested kiln %d: %v", i, err)
		}
	}

	select {
	case <-box.Done():
		t.Fatal("the nested kiln's start killed the host kiln's box: it took its group for a dead server's")
	default:
	}
	if res, err := box.RunPython(ctx, "print(2)", sandbox.ExecOptions{}); err != nil || strings.TrimSpace(res.Stdout.Text) != "2" {
		t.Fatalf("the host kiln's box after the nested kiln started: %v %+v", err, res)
	}
}

// TestPidNamespaceHelper is a nested kiln of TestKilnInAPidNamespace.
func TestPidNamespaceHelper(t *testing.T) {
	sync := os.Getenv("KILN_TEST_PIDNS_HELPER")
	if sync == "" {
		t.Skip("run by TestKilnInAPidNamespace")
	}
	me := os.Getenv("KILN_TEST_PIDNS_INDEX")
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := cgroupError(b); err != nil {
		t.Fatalf("the nested kiln has no cgroups: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), scaled(2*time.Minute))
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "nested-box", Limits: sandbox.Limits{MemoryBytes: 256 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	if res, err := box.RunPython(ctx, "held = bytearray(160 << 20); held[::4096] = b'x' * len(held[::4096]); print(3)", sandbox.ExecOptions{}); err != nil || strings.TrimSpace(res.Stdout.Text) != "3" {
		t.Fatalf("the nested kiln's box: %v %+v", err, res)
	}
	// Both hold their memory before either goes on.
	if err := os.WriteFile(filepath.Join(sync, me), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for {
		entries, _ := os.ReadDir(sync)
		if len(entries) >= 2 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the other nested kiln never got its box")
		case <-time.After(50 * time.Millisecond):
		}
	}
	if res, err := box.RunPython(ctx, "print(len(held) >> 20)", sandbox.ExecOptions{}); err != nil || strings.TrimSpace(res.Stdout.Text) != "160" {
		t.Fatalf("the nested kiln's box after the other filled its own: %v %+v", err, res)
	}
	t.Log("nested kiln's box ran")
}
