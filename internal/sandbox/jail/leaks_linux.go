package jail

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"kiln/internal/sandbox/boxkit"
)

// Leftovers lists what this server's boxes hold on the host right now: their
// cgroups, the processes in them, their mount points in the state directory
// and any mount under it. With no box open it should be empty; the hostile
// battery checks that after every case (the backend satisfies
// sandboxtest.LeakChecker; the assertion lives in the tests, so that kiln
// itself does not link the test suite).
func (b *Backend) Leftovers() []string {
	var out []string
	if b.cgroups != nil {
		for _, name := range b.cgroups.boxGroups() {
			out = append(out, "cgroup "+serverGroup()+"/"+name)
		}
	}
	out = append(out, processesInGroups("/"+serverGroup()+"/")...)
	entries, _ := os.ReadDir(b.opts.StateDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), statePrefix()) {
			out = append(out, "mount point "+filepath.Join(b.opts.StateDir, e.Name()))
		}
	}
	out = append(out, mountsUnder(b.opts.StateDir)...)
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

// mountsUnder lists the mounts of this mount namespace at or below dir,
// deepest first.
func mountsUnder(dir string) []string {
	mounts, _ := boxkit.MountsUnder(dir)
	out := make([]string, 0, len(mounts))
	for _, m := range mounts {
		out = append(out, "mount "+m)
	}
	return out
}
