package boxkit

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// The v2 tests run against a fake cgroupfs in a temporary directory: the
// machine kiln is developed on has cgroup v1 only, so real cgroup v2 is
// untested there. They check the layout decision and which value goes
// into which file; a kernel's answers to those writes they cannot.

// fakeCgroupfs makes a fake cgroup filesystem: v2 (cgroup.controllers at
// its root) or v1 (one directory per hierarchy, cpuacct a symlink to cpu as
// where the two share one).
func fakeCgroupfs(t *testing.T, v2 bool) string {
	t.Helper()
	root := t.TempDir()
	if v2 {
		if err := os.WriteFile(filepath.Join(root, "cgroup.controllers"), []byte("cpuset cpu io memory pids\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		return root
	}
	for _, h := range []string{"memory", "pids", "cpu", "blkio"} {
		if err := os.Mkdir(filepath.Join(root, h), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("cpu", filepath.Join(root, "cpuacct")); err != nil {
		t.Fatal(err)
	}
	return root
}

func readFiles(t *testing.T, dir string, files ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Errorf("reading %s: %v", f, err)
		}
		out[f] = string(b)
	}
	return out
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCgroupsLayout(t *testing.T) {
	v2 := fakeCgroupfs(t, true)
	c := CgroupsAt(v2)
	if !c.V2() {
		t.Errorf("%s with cgroup.controllers is not v2", v2)
	}
	if diff := cmp.Diff([]string{v2}, c.Hierarchies()); diff != "" {
		t.Errorf("v2 hierarchies (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{filepath.Join(v2, "kiln/1/box")}, c.Dirs("kiln/1/box")); diff != "" {
		t.Errorf("v2 dirs (-want +got):\n%s", diff)
	}

	v1 := fakeCgroupfs(t, false)
	c = CgroupsAt(v1)
	if c.V2() {
		t.Errorf("%s without cgroup.controllers is v2", v1)
	}
	var want []string
	for _, h := range []string{"blkio", "cpu", "memory", "pids"} { // not the cpuacct symlink
		want = append(want, filepath.Join(v1, h))
	}
	if diff := cmp.Diff(want, c.Hierarchies()); diff != "" {
		t.Errorf("v1 hierarchies (-want +got):\n%s", diff)
	}
}

func TestCgroupV2Files(t *testing.T) {
	root := fakeCgroupfs(t, true)
	c := CgroupsAt(root)
	if _, err := c.CreateParent("kiln/123"); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"", "kiln", "kiln/123"} {
		if got := readFiles(t, filepath.Join(root, d), "cgroup.subtree_control")["cgroup.subtree_control"]; got != "+memory +pids +cpu" {
			t.Errorf("%s/cgroup.subtree_control = %q", d, got)
		}
	}
	g, err := c.Create("kiln/123/box", CgroupLimits{MemoryBytes: 256 << 20, Pids: 64, CPUs: 1.5})
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "kiln/123/box")
	if diff := cmp.Diff([]string{dir}, g.Dirs()); diff != "" {
		t.Errorf("dirs (-want +got):\n%s", diff)
	}
	limits := []string{"memory.max", "memory.swap.max", "pids.max", "cpu.max"}
	want := map[string]string{"memory.max": "268435456", "memory.swap.max": "0", "pids.max": "64", "cpu.max": "150000 100000"}
	if diff := cmp.Diff(want, readFiles(t, dir, limits...)); diff != "" {
		t.Errorf("limits (-want +got):\n%s", diff)
	}
	if err := g.Limit(CgroupLimits{}); err != nil {
		t.Fatal(err)
	}
	want = map[string]string{"memory.max": "max", "memory.swap.max": "0", "pids.max": "max", "cpu.max": "max 100000"}
	if diff := cmp.Diff(want, readFiles(t, dir, limits...)); diff != "" {
		t.Errorf("no limits (-want +got):\n%s", diff)
	}
	if _, err := c.Create("kiln/123/box", CgroupLimits{}); !errors.Is(err, os.ErrExist) {
		t.Errorf("creating an existing group: %v, want it to exist", err)
	}

	if err := g.Add(42); err != nil {
		t.Fatal(err)
	}
	if got := readFiles(t, dir, "cgroup.procs")["cgroup.procs"]; got != "42" {
		t.Errorf("cgroup.procs = %q after adding 42", got)
	}
	if diff := cmp.Diff([]int{42}, g.Procs()); diff != "" {
		t.Errorf("procs (-want +got):\n%s", diff)
	}

	if n := g.OOMKills(); n != -1 {
		t.Errorf("OOMKills without memory.events = %d, want -1 (unknown)", n)
	}
	writeFile(t, filepath.Join(dir, "memory.events"), "low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\noom_group_kill 0\n")
	if n := g.OOMKills(); n != 2 {
		t.Errorf("OOMKills = %d, want memory.events' oom_kill 2", n)
	}
	if n := g.PidsRefused(); n != -1 {
		t.Errorf("PidsRefused without pids.events = %d, want -1 (unknown)", n)
	}
	writeFile(t, filepath.Join(dir, "pids.events"), "max 4\n")
	if n := g.PidsRefused(); n != 4 {
		t.Errorf("PidsRefused = %d, want pids.events' max 4", n)
	}
	writeFile(t, filepath.Join(dir, "cpu.stat"), "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n")
	if d, err := g.CPUUsage(); err != nil || d != 1500*time.Microsecond {
		t.Errorf("CPUUsage = %v, %v; want cpu.stat's usage_usec 1.5ms", d, err)
	}
}

func TestCgroupV1Files(t *testing.T) {
	root := fakeCgroupfs(t, false)
	c := CgroupsAt(root)
	if _, err := c.CreateParent("kiln/123"); err != nil {
		t.Fatal(err)
	}
	g, err := c.Create("kiln/123/box", CgroupLimits{MemoryBytes: 256 << 20, Pids: 64, CPUs: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, h := range []string{"memory", "pids", "cpu"} {
		dirs = append(dirs, filepath.Join(root, h, "kiln/123/box"))
	}
	if diff := cmp.Diff(dirs, g.Dirs()); diff != "" {
		t.Errorf("dirs (-want +got):\n%s", diff)
	}
	if _, err := os.Stat(filepath.Join(root, "blkio", "kiln")); err == nil {
		t.Errorf("a group in a hierarchy kiln does not limit with")
	}
	if m, _ := filepath.Glob(filepath.Join(root, "*", "cgroup.subtree_control")); len(m) > 0 {
		t.Errorf("v1 has no cgroup.subtree_control, but %v were written", m)
	}
	got := readFiles(t, dirs[0], "memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.swappiness")
	for k, v := range readFiles(t, dirs[1], "pids.max") {
		got[k] = v
	}
	for k, v := range readFiles(t, dirs[2], "cpu.cfs_period_us", "cpu.cfs_quota_us") {
		got[k] = v
	}
	want := map[string]string{
		"memory.limit_in_bytes":       "268435456",
		"memory.memsw.limit_in_bytes": "268435456",
		"memory.swappiness":           "0",
		"pids.max":                    "64",
		"cpu.cfs_period_us":           "100000",
		"cpu.cfs_quota_us":            "50000",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("limits (-want +got):\n%s", diff)
	}
	if err := g.Add(42); err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if got := readFiles(t, d, "cgroup.procs")["cgroup.procs"]; got != "42" {
			t.Errorf("%s/cgroup.procs = %q after adding 42", d, got)
		}
	}
	writeFile(t, filepath.Join(dirs[0], "memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
	if n := g.OOMKills(); n != 3 {
		t.Errorf("OOMKills = %d, want memory.oom_control's oom_kill 3", n)
	}
	// cpuacct shares cpu's hierarchy here (the symlink).
	writeFile(t, filepath.Join(dirs[2], "cpuacct.usage"), "2500000\n")
	if d, err := g.CPUUsage(); err != nil || d != 2500*time.Microsecond {
		t.Errorf("CPUUsage = %v, %v; want cpuacct.usage's 2.5ms", d, err)
	}
}

// TestCgroupSweep: the groups a stale predicate names go, with their own
// children; the others stay. (Empty directories: a fake cgroupfs cannot
// remove a directory with files in it, as the real one does.)
func TestCgroupSweep(t *testing.T) {
	for _, v2 := range []bool{true, false} {
		t.Run("v2="+strconv.FormatBool(v2), func(t *testing.T) {
			root := fakeCgroupfs(t, v2)
			c := CgroupsAt(root)
			for _, p := range []string{"kiln/100/box-a", "kiln/100/box-b", "kiln/200.box", "kiln/300/box"} {
				for _, d := range c.controllerDirs(p) {
					if err := os.MkdirAll(d, 0o755); err != nil {
						t.Fatal(err)
					}
				}
			}
			if diff := cmp.Diff([]string{"100", "200.box", "300"}, c.Children("kiln")); diff != "" {
				t.Errorf("children (-want +got):\n%s", diff)
			}
			removed, err := c.Sweep("kiln", func(name string) bool { return !strings.HasPrefix(name, "300") })
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff([]string{"100", "200.box"}, removed); diff != "" {
				t.Errorf("removed (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff([]string{"300"}, c.Children("kiln")); diff != "" {
				t.Errorf("left (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff([]string{"box"}, c.Children("kiln/300")); diff != "" {
				t.Errorf("left in the live group (-want +got):\n%s", diff)
			}
			if c.Group("kiln").RemoveIfEmpty() {
				t.Errorf("RemoveIfEmpty removed a group that holds one")
			}
		})
	}
}

func TestCgroupRootRefused(t *testing.T) {
	c := CgroupsAt(fakeCgroupfs(t, true))
	for _, p := range []string{"", "/", ".", "//"} {
		if err := c.Group(p).Destroy(); !errors.Is(err, errCgroupRoot) {
			t.Errorf("Destroy of the group at %q: %v, want a refusal", p, err)
		}
	}
}

// TestHostCgroupGroup runs a group on the host's cgroup filesystem (v1
// here): a process in it is listed, an allocation past its memory limit
// is an OOM kill it counts, and Destroy kills what is left and removes it.
func TestHostCgroupGroup(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root (creates cgroups)")
	}
	c := HostCgroups()
	if len(c.Hierarchies()) == 0 {
		t.Skip("no cgroup filesystem at " + CgroupRoot)
	}
	parent := "kiln-boxkit-test-" + strconv.Itoa(os.Getpid())
	pg, err := c.CreateParent(parent)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Group(parent).Destroy() })
	g, err := c.Create(parent+"/box", CgroupLimits{MemoryBytes: 32 << 20, Pids: 16, CPUs: 1})
	if err != nil {
		t.Fatal(err)
	}

	// Each waits for a line before it starts, so it is in the group first.
	start := func(script string) (*exec.Cmd, *os.File, chan struct{}) {
		t.Helper()
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("sh", "-c", "read x; "+script)
		cmd.Stdin = r
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		r.Close()
		t.Cleanup(func() { cmd.Process.Kill(); w.Close() })
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		if err := g.Add(cmd.Process.Pid); err != nil {
			t.Fatal(err)
		}
		return cmd, w, done
	}

	if n := g.OOMKills(); n != 0 {
		t.Errorf("OOMKills of a new group = %d", n)
	}
	_, w, done := start("exec python3 -c 'x = bytearray(128 << 20)'")
	w.WriteString("go\n")
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("the allocation past the limit neither ended nor was killed")
	}
	if n := g.OOMKills(); n < 1 {
		t.Errorf("OOMKills = %d after an allocation of 128 MiB in a group of 32 MiB", n)
	}

	sleeper, _, done := start("exec sleep 600")
	if !slices.Contains(g.Procs(), sleeper.Process.Pid) {
		t.Errorf("Procs = %v, without %d", g.Procs(), sleeper.Process.Pid)
	}
	if err := g.Destroy(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Errorf("the process in the group survives Destroy")
	}
	for _, d := range g.Dirs() {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("%s survives Destroy", d)
		}
	}
	if !pg.RemoveIfEmpty() {
		t.Errorf("the emptied parent was not removed")
	}
}
