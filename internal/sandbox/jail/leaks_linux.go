package jail

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Leftovers lists what this server's boxes hold on the host right now: their
// cgroups, the processes in them, their mount points in the state directory
// and any mount under it. With no box open it should be empty; the hostile
// battery checks that after every case (the backend satisfies
// sandboxtest.LeakChecker; the assertion lives in the tests, so that kiln
// itself does not link the test suite).
func (b *Backend) Leftovers() []string {
	var out []string
	prefix := strconv.Itoa(os.Getpid()) + "."
	for _, base := range cgroupBases(b.cgroups) {
		entries, _ := os.ReadDir(base)
		for _, e := range entries {
			if e.IsDir() && strings.HasPrefix(e.Name(), prefix) {
				out = append(out, "cgroup "+filepath.Join(base, e.Name()))
			}
		}
	}
	out = append(out, processesInGroups("/kiln/"+prefix)...)
	entries, _ := os.ReadDir(b.opts.StateDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), statePrefix(os.Getpid())) {
			out = append(out, "mount point "+filepath.Join(b.opts.StateDir, e.Name()))
		}
	}
	out = append(out, mountsUnder(b.opts.StateDir)...)
	return out
}

// cgroupBases are the directories that hold kiln's groups (none without
// cgroups).
func cgroupBases(c *cgroups) []string {
	if c == nil {
		return nil
	}
	if c.v2 {
		return []string{filepath.Join(cgroupRoot, "kiln")}
	}
	var out []string
	for _, ctrl := range v1Controllers {
		out = append(out, filepath.Join(cgroupRoot, ctrl, "kiln"))
	}
	return out
}

// processesInGroups lists host processes whose cgroup path contains group.
func processesInGroups(group string) []string {
	var out []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cgroup"))
		if err != nil || !strings.Contains(string(b), group) {
			continue
		}
		cmd, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		out = append(out, "process "+e.Name()+": "+strings.TrimSpace(strings.ReplaceAll(string(cmd), "\x00", " ")))
	}
	return out
}

// mountsUnder lists the mounts of this mount namespace at or below dir.
func mountsUnder(dir string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			out = append(out, "mount "+fields[4])
		}
	}
	return out
}
