package cli

import (
	"flag"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// bounds are the flags that bound the server's own resources: sessions per
// principal and in all, live boxes, and the cgroup of all boxes.
type bounds struct {
	maxSessions    int
	perPrincipal   int
	maxBoxes       int
	boxWait        time.Duration
	boxesMemoryMiB int64
	boxesPids      int
}

// register defines the session bounds; registerBoxes the rest.
func (b *bounds) register(fs *flag.FlagSet) {
	fs.IntVar(&b.maxSessions, "max-sessions", session.DefaultMaxSessions, "live sessions across all clients")
	fs.IntVar(&b.perPrincipal, "max-sessions-per-principal", session.DefaultMaxSessionsPerPrincipal, "live sessions one client (stdio process or HTTP token) may hold")
	fs.DurationVar(&b.boxWait, "box-wait", session.DefaultBoxWait, "how long a call waits for a sandbox when --max-boxes are in use before it gets a \"busy\" result")
}

// registerBoxes defines the bounds of the boxes themselves: how many, and
// the cgroup of them all.
func (b *bounds) registerBoxes(fs *flag.FlagSet) {
	fs.IntVar(&b.maxBoxes, "max-boxes", 0, "live sandboxes at once: sessions', per-call and the pool's (default: as many as fit the host's memory at --memory each, 4 to 64)")
	fs.Int64Var(&b.boxesMemoryMiB, "boxes-memory", 0, "jail: memory limit of all sandboxes together, MiB, a cgroup around them (default: --max-boxes × --memory, at most 90% of the host's memory)")
	fs.IntVar(&b.boxesPids, "boxes-pids", 0, "jail: process limit of all sandboxes together (default: --max-boxes × --pids)")
}

// resolve fills the defaults that depend on the per-box limits: the cap on
// live boxes, and the limits of all boxes together.
func (b *bounds) resolve(per sandbox.Limits) (maxBoxes int, all sandbox.Limits) {
	per = per.WithDefaults()
	maxBoxes = b.maxBoxes
	if maxBoxes <= 0 {
		maxBoxes = session.DefaultMaxBoxes(per)
	}
	all.MemoryBytes = b.boxesMemoryMiB << 20
	if all.MemoryBytes <= 0 {
		all.MemoryBytes = int64(maxBoxes) * per.MemoryBytes
		if host := session.HostMemory(); host > 0 {
			all.MemoryBytes = min(all.MemoryBytes, host/10*9)
		}
	}
	all.Pids = b.boxesPids
	if all.Pids <= 0 {
		all.Pids = maxBoxes * per.Pids
	}
	return maxBoxes, all
}

// apply sets the session bounds in o.
func (b *bounds) apply(maxBoxes int, o session.Options) session.Options {
	o.MaxSessions = b.maxSessions
	o.MaxSessionsPerPrincipal = b.perPrincipal
	o.MaxBoxes = maxBoxes
	o.BoxWait = b.boxWait
	return o
}
