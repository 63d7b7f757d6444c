package jail

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"kiln/internal/sandbox"
)

const cgroupRoot = "/sys/fs/cgroup"

// v1Controllers are the cgroup v1 hierarchies a box gets a group in.
var v1Controllers = []string{"memory", "pids", "cpu"}

// cgroups places boxes in cgroups under <root>/kiln (v2) or
// <root>/<controller>/kiln (v1). Each box's group is named
// "<server pid>.<box id>", so a restarted server can tell its dead
// predecessor's orphans from another live server's boxes.
type cgroups struct {
	v2 bool
}

// detectCgroups returns nil when the cgroup filesystem is not writable
// (not root, read-only): boxes then run with rlimits only, and doctor says so.
func detectCgroups() (*cgroups, error) {
	if _, err := os.Stat(filepath.Join(cgroupRoot, "cgroup.controllers")); err == nil {
		c := &cgroups{v2: true}
		base := filepath.Join(cgroupRoot, "kiln")
		if err := os.MkdirAll(base, 0o755); err != nil {
			return nil, fmt.Errorf("creating %s: %w", base, err)
		}
		for _, dir := range []string{cgroupRoot, base} {
			if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte("+memory +pids +cpu"), 0); err != nil {
				return nil, fmt.Errorf("enabling controllers in %s: %w", dir, err)
			}
		}
		if err := c.probe(); err != nil {
			return nil, err
		}
		return c, nil
	}
	for _, ctrl := range v1Controllers {
		base := filepath.Join(cgroupRoot, ctrl, "kiln")
		if err := os.MkdirAll(base, 0o755); err != nil {
			return nil, fmt.Errorf("creating %s: %w", base, err)
		}
	}
	c := &cgroups{}
	if err := c.probe(); err != nil {
		return nil, err
	}
	return c, nil
}

// probe makes and removes a group: kiln's directories may be there from an
// earlier run on a cgroup filesystem that is read-only now.
func (c *cgroups) probe() error {
	g := &cgroup{dirs: c.dirs(groupName("probe"))}
	defer g.destroy()
	for _, d := range g.dirs {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("creating a cgroup: %w", err)
		}
	}
	return nil
}

func (c *cgroups) dirs(name string) []string {
	if c.v2 {
		return []string{filepath.Join(cgroupRoot, "kiln", name)}
	}
	var out []string
	for _, ctrl := range v1Controllers {
		out = append(out, filepath.Join(cgroupRoot, ctrl, "kiln", name))
	}
	return out
}

func groupName(boxID string) string { return strconv.Itoa(os.Getpid()) + "." + boxID }

// create makes the box's group with its limits.
func (c *cgroups) create(boxID string, l sandbox.Limits) (*cgroup, error) {
	g := &cgroup{dirs: c.dirs(groupName(boxID))}
	for _, d := range g.dirs {
		if err := os.Mkdir(d, 0o755); err != nil {
			g.destroy()
			return nil, fmt.Errorf("creating cgroup: %w", err)
		}
	}
	quota := strconv.Itoa(int(l.CPUs * 100000))
	mem := strconv.FormatInt(l.MemoryBytes, 10)
	var settings [][2]string
	if c.v2 {
		d := g.dirs[0]
		settings = [][2]string{
			{d + "/memory.max", mem},
			{d + "/memory.swap.max", "0"},
			{d + "/pids.max", strconv.Itoa(l.Pids)},
			{d + "/cpu.max", quota + " 100000"},
		}
	} else {
		memDir, pidsDir, cpuDir := g.dirs[0], g.dirs[1], g.dirs[2]
		settings = [][2]string{
			{memDir + "/memory.limit_in_bytes", mem},
			{memDir + "/memory.memsw.limit_in_bytes", mem},
			{memDir + "/memory.swappiness", "0"},
			{pidsDir + "/pids.max", strconv.Itoa(l.Pids)},
			{cpuDir + "/cpu.cfs_period_us", "100000"},
			{cpuDir + "/cpu.cfs_quota_us", quota},
		}
	}
	for _, s := range settings {
		if err := os.WriteFile(s[0], []byte(s[1]), 0); err != nil {
			if errors.Is(err, os.ErrNotExist) && (strings.Contains(s[0], "memsw") || strings.Contains(s[0], "swap")) {
				continue // no swap accounting on this host: nothing to limit
			}
			g.destroy()
			return nil, fmt.Errorf("setting %s: %w", filepath.Base(s[0]), err)
		}
	}
	return g, nil
}

type cgroup struct{ dirs []string }

func (g *cgroup) add(pid int) error {
	for _, d := range g.dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("joining cgroup %s: %w", d, err)
		}
	}
	return nil
}

// memoryEvents reports whether the group hit its memory limit (v2
// memory.events oom_kill, v1 memory.failcnt / oom_control).
func (g *cgroup) oomKilled() bool {
	for _, d := range g.dirs {
		if b, err := os.ReadFile(filepath.Join(d, "memory.events")); err == nil {
			for _, line := range strings.Split(string(b), "\n") {
				if f := strings.Fields(line); len(f) == 2 && f[0] == "oom_kill" && f[1] != "0" {
					return true
				}
			}
		}
		if b, err := os.ReadFile(filepath.Join(d, "memory.oom_control")); err == nil {
			for _, line := range strings.Split(string(b), "\n") {
				if f := strings.Fields(line); len(f) == 2 && f[0] == "oom_kill" && f[1] != "0" {
					return true
				}
			}
		}
	}
	return false
}

// destroy kills whatever is still in the group and removes it.
func (g *cgroup) destroy() error {
	var errs []error
	for _, d := range g.dirs {
		errs = append(errs, removeGroup(d))
	}
	return errors.Join(errs...)
}

func removeGroup(d string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := os.Remove(d)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("removing cgroup %s: %w", d, err)
		}
		if b, rerr := os.ReadFile(filepath.Join(d, "cgroup.procs")); rerr == nil {
			for _, f := range strings.Fields(string(b)) {
				if pid, _ := strconv.Atoi(f); pid > 0 {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// removeOrphans removes the groups of kiln servers that are no longer
// running (killed with -9, say), killing what is left in them.
func (c *cgroups) removeOrphans() (removed int) {
	var bases []string
	if c.v2 {
		bases = []string{filepath.Join(cgroupRoot, "kiln")}
	} else {
		for _, ctrl := range v1Controllers {
			bases = append(bases, filepath.Join(cgroupRoot, ctrl, "kiln"))
		}
	}
	for _, base := range bases {
		entries, _ := os.ReadDir(base)
		for _, e := range entries {
			owner, _, ok := strings.Cut(e.Name(), ".")
			pid, err := strconv.Atoi(owner)
			if !ok || err != nil || !e.IsDir() || processAlive(pid) {
				continue
			}
			if removeGroup(filepath.Join(base, e.Name())) == nil {
				removed++
			}
		}
	}
	return removed
}

func processAlive(pid int) bool {
	return syscall.Kill(pid, 0) == nil || errors.Is(syscall.Kill(pid, 0), syscall.EPERM)
}
