package sandbox

// MemoryReporter is a box that can say how much memory it uses now: its
// cgroup's charge (RAM and the tmpfs pages charged to it), for the
// metrics.
type MemoryReporter interface {
	// MemoryUsage is the box's memory in use, in bytes; -1 when it cannot
	// be read (the box is gone, or its backend has no cgroup for it).
	MemoryUsage() int64
}
