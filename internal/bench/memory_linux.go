package bench

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// finderFor returns how to find a backend's boxes: with boxCgroups (the
// jail) each box's cgroup is in its server's, "<server pid>/<box id>";
// otherwise, and where those are missing, the server's process tree, one
// box per child subtree.
func finderFor(boxCgroups bool) boxFinder {
	if boxCgroups {
		return func(pid int) (map[string][]int, error) {
			boxes, err := cgroupBoxes(pid)
			if err == nil && len(boxes) > 0 {
				return boxes, nil
			}
			return treeBoxes(pid)
		}
	}
	return treeBoxes
}

// cgroupDirs are where the jail puts box groups (v2, then v1 memory).
var cgroupDirs = []string{"/sys/fs/cgroup/kiln", "/sys/fs/cgroup/memory/kiln"}

func cgroupBoxes(serverPid int) (map[string][]int, error) {
	for _, dir := range cgroupDirs {
		dir = filepath.Join(dir, strconv.Itoa(serverPid))
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		boxes := map[string][]int{}
		for _, e := range entries {
			if !e.IsDir() {
				continue
			}
			b, err := os.ReadFile(filepath.Join(dir, e.Name(), "cgroup.procs"))
			if err != nil {
				continue
			}
			var pids []int
			for _, f := range strings.Fields(string(b)) {
				if p, err := strconv.Atoi(f); err == nil {
					pids = append(pids, p)
				}
			}
			if len(pids) > 0 {
				boxes[e.Name()] = pids
			}
		}
		return boxes, nil
	}
	return nil, fmt.Errorf("no kiln cgroups under %v", cgroupDirs)
}

// children maps each pid to its child pids, from /proc/*/stat.
func children() map[int][]int {
	out := map[int][]int{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid …; comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 2 {
			continue
		}
		if ppid, err := strconv.Atoi(f[1]); err == nil {
			out[ppid] = append(out[ppid], pid)
		}
	}
	return out
}

func subtree(kids map[int][]int, pid int) []int {
	out := []int{pid}
	for _, c := range kids[pid] {
		out = append(out, subtree(kids, c)...)
	}
	return out
}

// treeBoxes takes each child subtree of the server as one box.
func treeBoxes(serverPid int) (map[string][]int, error) {
	kids := children()
	boxes := map[string][]int{}
	for _, c := range kids[serverPid] {
		boxes[strconv.Itoa(c)] = subtree(kids, c)
	}
	return boxes, nil
}

// sharedMemory sums the PSS of the server's descendants that belong to no
// box (a zygote template, helpers), in KiB.
func sharedMemory(serverPid int, boxes map[string][]int) (int64, bool) {
	in := map[int]bool{}
	for _, pids := range boxes {
		for _, p := range pids {
			in[p] = true
		}
	}
	var total int64
	found := false
	for _, p := range subtree(children(), serverPid)[1:] {
		if in[p] {
			continue
		}
		if m, err := readMemory(p); err == nil {
			total += m.Pss
			found = true
		}
	}
	return total, found
}

func readMemory(pid int) (memInfo, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return memInfo{}, err
	}
	defer f.Close()
	var m memInfo
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "Rss":
			m.Rss = n
		case "Pss":
			m.Pss = n
		case "Private_Clean", "Private_Dirty":
			m.Private += n
		}
	}
	return m, sc.Err()
}

// cpuGroup is a cgroup that the bench, and so every server and box it
// starts, runs in, to count their CPU time whatever else the machine is
// doing. The jail moves boxes into cgroups of its own in the cpu, memory
// and pids hierarchies; where cpuacct is a hierarchy of its own (cgroup v1)
// they stay counted here. Under cgroup v2 they leave, and the count covers
// only kiln itself.
type cpuGroup struct {
	dir, parent string
	v2          bool
}

func newCPUGroup() (*cpuGroup, error) {
	name := fmt.Sprintf("kiln-bench-%d", os.Getpid())
	g := &cpuGroup{parent: "/sys/fs/cgroup/cpuacct"}
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		g.parent, g.v2 = "/sys/fs/cgroup", true
	} else if st, err := os.Lstat(g.parent); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("no cpuacct hierarchy of its own at %s", g.parent)
	}
	g.dir = filepath.Join(g.parent, name)
	if err := os.Mkdir(g.dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating cpu accounting group: %w", err)
	}
	if err := os.WriteFile(filepath.Join(g.dir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		os.Remove(g.dir)
		return nil, fmt.Errorf("joining cpu accounting group: %w", err)
	}
	return g, nil
}

// covers says what the group's count holds.
func (g *cpuGroup) covers() string {
	if g.v2 {
		return "cgroup v2: the bench's group minus the bench (kiln's servers), plus the groups the backend moves its boxes to"
	}
	return "cgroup v1, cpuacct of its own: the bench's group minus the bench (kiln's servers, and the jail's boxes, which stay in it), plus the groups the backend moves its boxes to"
}

// usage is the CPU time used in the group so far.
func (g *cpuGroup) usage() (time.Duration, error) { return g.dirUsage(g.dir) }

// groupsUsage is the CPU time used so far in the groups at rels, relative
// to the hierarchy's root; a group that does not exist counts nothing.
func (g *cpuGroup) groupsUsage(rels []string) time.Duration {
	var total time.Duration
	for _, rel := range rels {
		if d, err := g.dirUsage(filepath.Join(g.parent, filepath.Clean("/"+rel))); err == nil {
			total += d
		}
	}
	return total
}

// dirUsage is the CPU time of the group at dir, its descendants, live
// and removed, included.
func (g *cpuGroup) dirUsage(dir string) (time.Duration, error) {
	if g.v2 {
		b, err := os.ReadFile(filepath.Join(dir, "cpu.stat"))
		if err != nil {
			return 0, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				return time.Duration(n) * time.Microsecond, err
			}
		}
		return 0, errors.New("no usage_usec in cpu.stat")
	}
	b, err := os.ReadFile(filepath.Join(dir, "cpuacct.usage"))
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return time.Duration(n), err
}

// selfCPU is the CPU time of the bench process itself.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// close leaves the group and removes it once its processes are gone.
func (g *cpuGroup) close() {
	os.WriteFile(filepath.Join(g.parent, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0)
	for range 50 {
		if os.Remove(g.dir) == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// loadAverage is /proc/loadavg's first three fields.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

// processRole names a box's process for the memory breakdown: its
// command, and "PID 1" for the first process of the box's pid namespace.
func processRole(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "?"
	}
	var comm, nspid string
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Name:"); ok {
			comm = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				nspid = f[len(f)-1]
			}
		}
	}
	if nspid == "1" {
		return comm + " (PID 1)"
	}
	return comm
}
