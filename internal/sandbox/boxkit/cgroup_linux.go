package boxkit

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// CgroupRoot is where the host mounts its cgroup hierarchies.
const CgroupRoot = "/sys/fs/cgroup"

// Cgroups is a cgroup filesystem: cgroup v2's unified hierarchy at its
// root (the root holds cgroup.controllers), or cgroup v1's hierarchies,
// one directory under the root each (memory, pids, cpu, …; a hybrid host's
// "unified" v2 tree counts as one of them). Every backend puts its boxes
// (or their VMMs) in groups made here, and sweeps the groups of dead kiln
// processes with it.
//
// Only cgroup v1 runs on the machine kiln is developed on: the v2 paths
// are tested against a fake cgroupfs in a temporary directory (file
// layout, what is written where, what is read back), never against a
// real v2 kernel there.
type Cgroups struct {
	root string
	v2   bool
}

// HostCgroups is the host's cgroup filesystem at CgroupRoot.
func HostCgroups() *Cgroups { return CgroupsAt(CgroupRoot) }

// CgroupsAt is the cgroup filesystem mounted at root: v2 if root holds
// cgroup.controllers, else v1.
func CgroupsAt(root string) *Cgroups {
	_, err := os.Stat(filepath.Join(root, "cgroup.controllers"))
	return &Cgroups{root: root, v2: err == nil}
}

// Root is the directory the filesystem's paths are under: the mount
// point, or a delegated group (DelegatedCgroups).
func (c *Cgroups) Root() string { return c.root }

// V2 reports whether the filesystem is cgroup v2's unified hierarchy.
func (c *Cgroups) V2() bool { return c.v2 }

// cgroupV1Controllers are the v1 hierarchies the groups kiln makes live in.
var cgroupV1Controllers = []string{"memory", "pids", "cpu"}

// cgroupV2Controllers are what a v2 parent group enables for its children.
const cgroupV2Controllers = "+memory +pids +cpu"

// cgroupPeriod is the CPU bandwidth period, µs.
const cgroupPeriod = 100000

// cgroupGrace is how long killing a group's processes, and removing it
// while the kernel empties it, may take.
const cgroupGrace = 5 * time.Second

// Hierarchies lists the directories of every hierarchy: the root (v2), or
// each directory under it (v1; symlinks such as cpu -> cpu,cpuacct are
// skipped, their target is listed).
func (c *Cgroups) Hierarchies() []string {
	if c.v2 {
		return []string{c.root}
	}
	entries, _ := os.ReadDir(c.root)
	var out []string
	for _, e := range entries {
		if e.IsDir() {
			out = append(out, filepath.Join(c.root, e.Name()))
		}
	}
	return out
}

// Dirs are the directories of the group at path in every hierarchy,
// whether they exist or not.
func (c *Cgroups) Dirs(path string) []string {
	var out []string
	for _, h := range c.Hierarchies() {
		out = append(out, filepath.Join(h, path))
	}
	return out
}

// Group is the group at path in every hierarchy: one made by someone else
// (runsc makes its own from the OCI spec) or left by a dead process.
func (c *Cgroups) Group(path string) *CgroupGroup {
	return &CgroupGroup{c: c, path: path, dirs: c.Dirs(path)}
}

// controllerDirs are the directories of path in the hierarchies kiln's
// groups live in, in the order of cgroupV1Controllers (v1).
func (c *Cgroups) controllerDirs(path string) []string {
	if c.v2 {
		return []string{filepath.Join(c.root, path)}
	}
	var out []string
	for _, ctrl := range cgroupV1Controllers {
		out = append(out, filepath.Join(c.root, ctrl, path))
	}
	return out
}

// CreateParent makes the group at path, and its ancestors, to hold
// others; it may exist already. On v2 it enables the memory, pids and cpu
// controllers for the children of the root, of each ancestor and of path.
func (c *Cgroups) CreateParent(path string) (*CgroupGroup, error) {
	g := &CgroupGroup{c: c, path: path, dirs: c.controllerDirs(path)}
	for _, d := range g.dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("creating cgroup %s: %w", d, err)
		}
	}
	if !c.v2 {
		return g, nil
	}
	dirs := []string{c.root}
	rel := ""
	for _, part := range strings.Split(strings.Trim(filepath.Clean("/"+path), "/"), "/") {
		rel = filepath.Join(rel, part)
		dirs = append(dirs, filepath.Join(c.root, rel))
	}
	for _, d := range dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.subtree_control"), []byte(cgroupV2Controllers), 0); err != nil {
			return nil, fmt.Errorf("enabling controllers in %s: %w", d, err)
		}
	}
	return g, nil
}

// Create makes the group at path with limits l. Its parent must exist
// (CreateParent); the group itself must not.
func (c *Cgroups) Create(path string, l CgroupLimits) (*CgroupGroup, error) {
	g := &CgroupGroup{c: c, path: path}
	for _, d := range c.controllerDirs(path) {
		if err := os.Mkdir(d, 0o755); err != nil {
			g.Destroy()
			return nil, fmt.Errorf("creating cgroup: %w", err)
		}
		g.dirs = append(g.dirs, d)
	}
	if err := g.Limit(l); err != nil {
		g.Destroy()
		return nil, err
	}
	return g, nil
}

// Children lists the names of the groups directly under path, in any
// hierarchy, sorted, each once.
func (c *Cgroups) Children(path string) []string {
	var out []string
	for _, d := range c.Dirs(path) {
		entries, _ := os.ReadDir(d)
		for _, e := range entries {
			if e.IsDir() && !slices.Contains(out, e.Name()) {
				out = append(out, e.Name())
			}
		}
	}
	slices.Sort(out)
	return out
}

// Sweep destroys the groups under parent whose name stale accepts (a dead
// process's), killing what is still in them and their own children, and
// returns the names of those it removed.
func (c *Cgroups) Sweep(parent string, stale func(name string) bool) (removed []string, err error) {
	var errs []error
	for _, name := range c.Children(parent) {
		if !stale(name) {
			continue
		}
		if err := c.Group(filepath.Join(parent, name)).Destroy(); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, name)
	}
	return removed, errors.Join(errs...)
}

// CgroupLimits bound what a group's processes use together. A zero field
// means no limit of that kind.
type CgroupLimits struct {
	MemoryBytes int64 // memory; the group never swaps
	Pids        int
	CPUs        float64 // CPU bandwidth, in CPUs
}

// cgroupSetting is one value written into one file of the group, in the
// hierarchy of controller ctrl (v1).
type cgroupSetting struct{ ctrl, file, value string }

// settings are the files that set l, in the order they are written.
func (c *Cgroups) settings(l CgroupLimits) []cgroupSetting {
	limit := func(n int64, none string) string {
		if n <= 0 {
			return none
		}
		return strconv.FormatInt(n, 10)
	}
	quota := int64(l.CPUs * cgroupPeriod)
	if c.v2 {
		return []cgroupSetting{
			{"", "memory.max", limit(l.MemoryBytes, "max")},
			{"", "memory.swap.max", "0"},
			{"", "pids.max", limit(int64(l.Pids), "max")},
			{"", "cpu.max", limit(quota, "max") + " " + strconv.Itoa(cgroupPeriod)},
		}
	}
	return []cgroupSetting{
		// memsw may never be below the memory limit: lift it first.
		{"memory", "memory.memsw.limit_in_bytes", "-1"},
		{"memory", "memory.limit_in_bytes", limit(l.MemoryBytes, "-1")},
		{"memory", "memory.memsw.limit_in_bytes", limit(l.MemoryBytes, "-1")},
		{"memory", "memory.swappiness", "0"},
		{"pids", "pids.max", limit(int64(l.Pids), "max")},
		{"cpu", "cpu.cfs_period_us", strconv.Itoa(cgroupPeriod)},
		{"cpu", "cpu.cfs_quota_us", limit(quota, "-1")},
	}
}

// CgroupGroup is one cgroup: its directory in each hierarchy it spans.
type CgroupGroup struct {
	c    *Cgroups
	path string
	dirs []string
}

// Path is the group's path under each hierarchy.
func (g *CgroupGroup) Path() string { return g.path }

// Dirs are the group's directories.
func (g *CgroupGroup) Dirs() []string { return g.dirs }

// dir is the group's directory in controller ctrl's hierarchy (v1), or
// its only one (v2).
func (g *CgroupGroup) dir(ctrl string) string {
	if g.c.v2 {
		ctrl = ""
	}
	return filepath.Join(g.c.root, ctrl, g.path)
}

// Limit sets the group's limits; zero fields lift that limit. A host
// without swap accounting has no swap files: nothing to limit there.
func (g *CgroupGroup) Limit(l CgroupLimits) error {
	for _, s := range g.c.settings(l) {
		p := filepath.Join(g.dir(s.ctrl), s.file)
		if err := os.WriteFile(p, []byte(s.value), 0); err != nil {
			if errors.Is(err, fs.ErrNotExist) && (strings.Contains(s.file, "memsw") || strings.Contains(s.file, "swap")) {
				continue
			}
			return fmt.Errorf("limiting cgroup: setting %s to %s: %w", p, s.value, err)
		}
	}
	return nil
}

// Add moves a process (all its threads) into the group.
func (g *CgroupGroup) Add(pid int) error {
	for _, d := range g.dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("joining cgroup %s: %w", d, err)
		}
	}
	return nil
}

// OOMKills is how many processes of the group the kernel killed for going
// over its memory limit (v2 memory.events, v1 memory.oom_control); -1 if
// it cannot be read (the group is gone).
func (g *CgroupGroup) OOMKills() int64 {
	file := "memory.oom_control"
	if g.c.v2 {
		file = "memory.events"
	}
	n, err := cgroupReadKey(filepath.Join(g.dir("memory"), file), "oom_kill")
	if err != nil {
		return -1
	}
	return n
}

// PidsRefused is how many forks and clones in the group failed at its pids
// limit (pids.events "max", v1 and v2); -1 if the kernel does not count
// them.
func (g *CgroupGroup) PidsRefused() int64 {
	n, err := cgroupReadKey(filepath.Join(g.dir("pids"), "pids.events"), "max")
	if err != nil {
		return -1
	}
	return n
}

// CPUUsage is the CPU time the group's processes have used (v2 cpu.stat,
// v1 cpuacct.usage: the group must span the cpuacct hierarchy, as it does
// where cpu and cpuacct share one).
func (g *CgroupGroup) CPUUsage() (time.Duration, error) {
	if g.c.v2 {
		n, err := cgroupReadKey(filepath.Join(g.dir(""), "cpu.stat"), "usage_usec")
		return time.Duration(n) * time.Microsecond, err
	}
	b, err := os.ReadFile(filepath.Join(g.dir("cpuacct"), "cpuacct.usage"))
	if err != nil {
		return 0, fmt.Errorf("reading cpu usage: %w", err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("reading cpu usage: %w", err)
	}
	return time.Duration(n), nil
}

// cgroupReadKey reads key's value from a flat-keyed file ("key value" per
// line).
func cgroupReadKey(file, key string) (int64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", key, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == key {
			n, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("reading %s: %w", key, err)
			}
			return n, nil
		}
	}
	return 0, fmt.Errorf("reading %s: not in %s", key, file)
}

// Procs lists the processes in the group itself (not in its children),
// each once.
func (g *CgroupGroup) Procs() []int {
	var out []int
	for _, d := range g.dirs {
		for _, pid := range cgroupReadProcs(d) {
			if !slices.Contains(out, pid) {
				out = append(out, pid)
			}
		}
	}
	return out
}

func cgroupReadProcs(dir string) []int {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			pids = append(pids, pid)
		}
	}
	return pids
}

// errCgroupRoot refuses to kill or remove a hierarchy's root.
var errCgroupRoot = errors.New("refusing to kill or remove the root cgroup")

// Destroy kills every process in the group and its children and removes
// them all. A group that is not there is no error.
func (g *CgroupGroup) Destroy() error {
	if strings.Trim(filepath.Clean("/"+g.path), "/") == "" {
		return errCgroupRoot
	}
	var errs []error
	for _, d := range g.dirs {
		errs = append(errs, cgroupDestroyDir(d, g.c.v2))
	}
	return errors.Join(errs...)
}

// cgroupDestroyDir destroys dir's children, then kills what is in dir and
// removes it.
func cgroupDestroyDir(dir string, v2 bool) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	var errs []error
	for _, e := range entries {
		if e.IsDir() {
			errs = append(errs, cgroupDestroyDir(filepath.Join(dir, e.Name()), v2))
		}
	}
	deadline := time.Now().Add(cgroupGrace)
	for {
		pids := cgroupReadProcs(dir)
		if len(pids) == 0 {
			break
		}
		if time.Now().After(deadline) {
			return errors.Join(append(errs, fmt.Errorf("processes %v survive in cgroup %s", pids, dir))...)
		}
		if v2 {
			os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The kernel may take a moment to empty a group whose last process
	// died: it is busy until then.
	for {
		err := syscall.Rmdir(dir)
		if err == nil || errors.Is(err, syscall.ENOENT) {
			break
		}
		if !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
			errs = append(errs, fmt.Errorf("removing cgroup %s: %w", dir, err))
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	return errors.Join(errs...)
}

// RemoveIfEmpty removes the group if nothing is in it, and reports
// whether it removed any of its directories. A group that still holds
// processes or groups (of another backend, another kiln process) stays.
func (g *CgroupGroup) RemoveIfEmpty() (removed bool) {
	for _, d := range g.dirs {
		if syscall.Rmdir(d) == nil {
			removed = true
		}
	}
	return removed
}
