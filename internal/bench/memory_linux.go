package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// finderFor returns how to find a backend's boxes: the jail names each
// box's cgroup "<server pid>.<box id>"; other backends fall back to the
// server's process tree, one box per child subtree.
func finderFor(backend string) boxFinder {
	if backend == "jail" {
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
	prefix := strconv.Itoa(serverPid) + "."
	for _, dir := range cgroupDirs {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		boxes := map[string][]int{}
		for _, e := range entries {
			if !e.IsDir() || !strings.HasPrefix(e.Name(), prefix) {
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
