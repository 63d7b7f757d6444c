package gvisor

import "kiln/internal/sandbox"

var _ sandbox.MemoryReporter = (*gvBox)(nil)

// MemoryUsage is the memory charged to the box's host cgroup (the
// sandbox's kernel and everything in it); -1 without one.
func (g *gvBox) MemoryUsage() int64 {
	if g.bx.cgroup == "" {
		return -1
	}
	return g.bx.b.cgroups.Group(g.bx.cgroup).MemoryUsage()
}
