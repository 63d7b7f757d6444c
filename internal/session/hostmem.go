package session

import (
	"kiln/internal/sandbox"
)

// Defaults of the cap on live boxes when the configuration names none.
const (
	minDefaultBoxes = 4
	maxDefaultBoxes = 64
)

// DefaultMaxBoxes is the cap on live boxes when none is configured: as
// many boxes as fit the host's memory at their memory limit, at least 4
// and at most 64. A box's limit is a ceiling, not what it uses, so the
// floor may overcommit a small host; the warning at start says so, and
// the jail's cgroup for all boxes bounds what they use together.
func DefaultMaxBoxes(l sandbox.Limits) int {
	l = l.WithDefaults()
	mem := HostMemory()
	if mem <= 0 {
		return minDefaultBoxes
	}
	return int(min(max(mem/l.MemoryBytes, minDefaultBoxes), maxDefaultBoxes))
}

// HostMemory is the host's RAM in bytes (0 when unknown).
func HostMemory() int64 { return hostMemory() }

// warnOvercommit logs when the live boxes may together be allowed more
// memory than the host has.
func (m *Manager) warnOvercommit() {
	m.log.Info("server bounds", "max_boxes", m.opts.MaxBoxes, "box_wait", m.opts.BoxWait,
		"max_sessions", m.opts.MaxSessions, "max_sessions_per_principal", m.opts.MaxSessionsPerPrincipal)
	host := HostMemory()
	total := int64(m.opts.MaxBoxes) * m.opts.Limits.MemoryBytes
	if host > 0 && total > host {
		m.log.Warn("live sandboxes may be allowed more memory than the host has: lower --max-boxes or --memory, or rely on the cgroup limit for all boxes",
			"max_boxes", m.opts.MaxBoxes, "memory_per_box_mib", m.opts.Limits.MemoryBytes>>20,
			"total_mib", total>>20, "host_mib", host>>20)
	}
}
