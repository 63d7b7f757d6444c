package jail

import "kiln/internal/sandbox"

var _ sandbox.MemoryReporter = (*jailBox)(nil)

// MemoryUsage is the memory charged to the box's cgroup; -1 without one.
func (j *jailBox) MemoryUsage() int64 {
	if j.cg == nil {
		return -1
	}
	return j.cg.MemoryUsage()
}
