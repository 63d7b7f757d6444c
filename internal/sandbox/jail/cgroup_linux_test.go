package jail_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// TestAllBoxesLimit: the server's cgroup bounds its boxes together, below
// what each box may use alone: forks past its pids limit are refused and
// memory past its limit is not granted, though each box's own limits are
// higher.
func TestAllBoxesLimit(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the jail tests need root (user namespaces with a uid range, cgroups)")
	}
	const memLimit, pidsLimit = 192 << 20, 48
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), AllBoxes: sandbox.Limits{MemoryBytes: memLimit, Pids: pidsLimit}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	t.Cleanup(func() {
		// The group is the process's: lift its limits for the tests after.
		if b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t)}); err == nil {
			b.Close()
		}
	})
	if _, err := os.Stat("/sys/fs/cgroup/memory"); err != nil {
		if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err != nil {
			t.Skip("no cgroup filesystem")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "allboxes", Limits: sandbox.Limits{MemoryBytes: 1 << 30, Pids: 256}})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()

	// The box's group sits in the server's, which has the limits.
	server := []string{
		fmt.Sprintf("/sys/fs/cgroup/memory/%s/memory.limit_in_bytes", ownGroup()),
		fmt.Sprintf("/sys/fs/cgroup/pids/%s/pids.max", ownGroup()),
		fmt.Sprintf("/sys/fs/cgroup/pids/%s/allboxes", ownGroup()),
	}
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		server = []string{
			fmt.Sprintf("/sys/fs/cgroup/%s/memory.max", ownGroup()),
			fmt.Sprintf("/sys/fs/cgroup/%s/pids.max", ownGroup()),
			fmt.Sprintf("/sys/fs/cgroup/%s/allboxes", ownGroup()),
		}
	}
	for i, want := range []string{fmt.Sprint(memLimit), fmt.Sprint(pidsLimit)} {
		got, err := os.ReadFile(server[i])
		if err != nil || strings.TrimSpace(string(got)) != want {
			t.Errorf("%s = %q (%v), want %s", filepath.Base(server[i]), got, err, want)
		}
	}
	if _, err := os.Stat(server[2]); err != nil {
		t.Errorf("the box's group is not in the server's: %v", err)
	}

	res, err := box.RunPython(ctx, `
import os, time
n, refused = 0, None
try:
    for _ in range(100):
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    refused = e.errno
print("forked", n, "refused", refused)
`, sandbox.ExecOptions{})
	switch {
	case errors.Is(err, sandbox.ErrDied):
		// The limit bound the agent's own threads first: the box died of
		// it, which is the limit holding too.
		t.Logf("the box died at the server's pids limit")
	case err != nil:
		t.Fatal(err)
	default:
		var forked int
		var refused string
		fmt.Sscanf(res.Stdout.Text, "forked %d refused %s", &forked, &refused)
		if forked >= pidsLimit || refused == "None" || refused == "" {
			t.Errorf("forks past the server's pids limit of %d: %q %+v", pidsLimit, res.Stdout.Text, res.Error)
		}
	}
	box.Close()

	box, err = b.Create(ctx, sandbox.Spec{ID: "allboxes-mem", Limits: sandbox.Limits{MemoryBytes: 1 << 30}})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	res, err = box.RunPython(ctx, "x = b'x' * (400 << 20)\nprint('allocated', len(x))", sandbox.ExecOptions{})
	if err == nil && strings.Contains(res.Stdout.Text, "allocated") {
		t.Errorf("a box got 400 MiB past the server's memory limit of %d MiB: %q", memLimit>>20, res.Stdout.Text)
	}
	t.Logf("the allocation past the limit: err %v, result %+v", err, res)
}

// TestCPULimit: a box's CPU bandwidth is its cgroup's quota (v2 cpu.max,
// v1 cpu.cfs_quota_us), and a spin in the box is throttled to it. A
// control box without a quota spins first: where it is not throttled
// the counter works, and the limited box's throttling is the quota's.
func TestCPULimit(t *testing.T) {
	b := newBackend(t)
	ctx, cancel := context.WithTimeout(context.Background(), scaled(2*time.Minute))
	defer cancel()
	v2 := true
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err != nil {
		v2 = false
	}
	group := func(id string) string {
		if v2 {
			return fmt.Sprintf("/sys/fs/cgroup/%s/%s", ownGroup(), id)
		}
		return fmt.Sprintf("/sys/fs/cgroup/cpu/%s/%s", ownGroup(), id)
	}
	throttled := func(t *testing.T, id string) int64 {
		t.Helper()
		data, err := os.ReadFile(filepath.Join(group(id), "cpu.stat"))
		if err != nil {
			t.Fatalf("reading the box's cpu.stat: %v", err)
		}
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "nr_throttled "); ok {
				var n int64
				fmt.Sscan(v, &n)
				return n
			}
		}
		t.Fatalf("no nr_throttled in cpu.stat:\n%s", data)
		return 0
	}
	// Two seconds of wall time spent spinning; the CPU time it got.
	const spin = "import time\nw = time.monotonic() + 2\nwhile time.monotonic() < w:\n    pass\nprint(round(time.process_time(), 2))"
	run := func(t *testing.T, id string, cpus float64) (cpu string, nThrottled int64) {
		t.Helper()
		box, err := b.Create(ctx, sandbox.Spec{ID: id, Limits: sandbox.Limits{CPUs: cpus}})
		if err != nil {
			t.Fatal(err)
		}
		defer box.Close()
		res, err := box.RunPython(ctx, spin, sandbox.ExecOptions{})
		if err != nil || res.Error != nil {
			t.Fatalf("spinning: %v %+v", err, res)
		}
		return strings.TrimSpace(res.Stdout.Text), throttled(t, id)
	}
	cpu, n := run(t, "cpu-control", 64)
	if n != 0 {
		t.Skipf("a box with a quota of 64 CPUs was throttled %d times (cpu %s s of 2 s): this host's throttling counter cannot tell a quota", n, cpu)
	}
	t.Logf("control: %s s of CPU in 2 s, never throttled", cpu)

	box, err := b.Create(ctx, sandbox.Spec{ID: "cpu-limited", Limits: sandbox.Limits{CPUs: 0.25}})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	file, want := "cpu.max", "25000 100000"
	if !v2 {
		file, want = "cpu.cfs_quota_us", "25000"
	}
	got, err := os.ReadFile(filepath.Join(group("cpu-limited"), file))
	if err != nil || strings.TrimSpace(string(got)) != want {
		t.Errorf("%s = %q (%v), want %q", file, got, err, want)
	}
	res, err := box.RunPython(ctx, spin, sandbox.ExecOptions{})
	if err != nil || res.Error != nil {
		t.Fatalf("spinning: %v %+v", err, res)
	}
	n = throttled(t, "cpu-limited")
	t.Logf("limited to 0.25 CPU: %s s of CPU in 2 s, throttled %d times", strings.TrimSpace(res.Stdout.Text), n)
	if n == 0 {
		t.Errorf("a spin under a quota of 0.25 CPU was never throttled")
	}
}
