package gvisor

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// templatePrefix starts the container ID of every template box.
const templatePrefix = "kiln-template-"

// Leftovers lists what this process's gVisor boxes hold on the host right
// now: their cgroups, their directories in the state directory and the host
// processes of either (runsc, gofer, sandbox, stubs). With no box open it
// should be empty; the hostile battery checks that after every case (the
// backend satisfies sandboxtest.LeakChecker, asserted in the tests). Warm-
// start templates are the backend's own, built in the background and gone
// once checkpointed; they are not listed.
func (b *Backend) Leftovers() []string {
	var out []string
	prefix := b.owner + "."
	seen := map[int]bool{}
	for _, name := range b.cgroups.Children(CgroupParent) {
		if !strings.HasPrefix(name, prefix) || strings.HasPrefix(name, prefix+templatePrefix) {
			continue
		}
		out = append(out, "cgroup "+CgroupParent+"/"+name)
		for _, pid := range b.cgroups.Group(CgroupParent + "/" + name).Procs() {
			if !seen[pid] {
				seen[pid] = true
				out = append(out, "process "+describeProcess(pid))
			}
		}
	}
	boxes := filepath.Join(b.dir, "boxes")
	entries, _ := os.ReadDir(boxes)
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), templatePrefix) {
			out = append(out, "box directory "+filepath.Join(boxes, e.Name()))
		}
	}
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || seen[pid] {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err != nil {
			continue
		}
		s := string(cmd)
		if i := strings.Index(s, boxes+"/"); i >= 0 && !strings.HasPrefix(s[i+len(boxes)+1:], templatePrefix) {
			out = append(out, "process "+describeProcess(pid))
		}
	}
	return out
}

func describeProcess(pid int) string {
	cmd, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	return strconv.Itoa(pid) + ": " + strings.ReplaceAll(string(cmd), "\x00", " ")
}
