package jail

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// cgroups places boxes in cgroups under one group per server:
// kiln/<server pid>/<box id> in each hierarchy (v2's unified one, or v1's
// memory, pids and cpu). The server's group bounds all its boxes together
// (memory, pids), and its name lets a restarted server tell its dead
// predecessor's orphans from another live server's boxes.
type cgroups struct {
	fs     *boxkit.Cgroups
	server *boxkit.CgroupGroup
}

// detectCgroups returns an error when the cgroup filesystem is not writable
// (read-only, or not root and no cgroup v2 subtree delegated to the user):
// boxes then run with rlimits only, and doctor says so. all limits this
// server's boxes together; its zero fields mean no limit of that kind.
// Rootless, the groups live under the user's delegated group
// (boxkit.DelegatedCgroups), which kiln and the process that started it
// leave for a leaf beside them.
func detectCgroups(all sandbox.Limits, rootless bool) (*cgroups, error) {
	c := &cgroups{fs: boxkit.HostCgroups()}
	var err error
	if rootless {
		if c.fs, err = boxkit.DelegatedCgroups(); err != nil {
			return nil, err
		}
	}
	if c.server, err = c.fs.CreateParent(serverGroup()); err != nil {
		return nil, err
	}
	// Every backend of one process shares the group (tests make several),
	// and the last one made sets its limits.
	if err := c.server.Limit(boxkit.CgroupLimits{MemoryBytes: all.MemoryBytes, Pids: all.Pids}); err != nil {
		return nil, fmt.Errorf("limiting all boxes: %w", err)
	}
	// kiln's directories may be there from an earlier run on a cgroup
	// filesystem that is read-only now: make and remove a group.
	probe, err := c.fs.CreateParent(serverGroup() + "/probe")
	if err != nil {
		return nil, err
	}
	probe.Destroy()
	return c, nil
}

// serverGroup is this server's group, the parent of its boxes' groups.
func serverGroup() string { return ServerCgroupParent + "/" + strconv.Itoa(os.Getpid()) }

// create makes the box's group with its limits.
func (c *cgroups) create(boxID string, l sandbox.Limits) (*boxkit.CgroupGroup, error) {
	return c.fs.Create(serverGroup()+"/"+boxID, boxkit.CgroupLimits{MemoryBytes: l.MemoryBytes, Pids: l.Pids, CPUs: l.CPUs})
}

// closeServer removes the server's group if no box is left in it (another
// backend of this process may still have some).
func (c *cgroups) closeServer() { c.server.RemoveIfEmpty() }

// boxGroups lists the names of this server's box groups.
func (c *cgroups) boxGroups() []string { return c.fs.Children(serverGroup()) }

// removeOrphans removes the groups of kiln servers that are no longer
// running (killed with -9, say, or a zombie), killing what is left in
// them: each dead server's group with its boxes' groups, and box groups of
// the earlier layout (<pid>.<box id> directly under kiln). The names carry
// the pid only (bench and tests read this layout), so a reused pid keeps a
// dead server's groups until that process is gone too.
func (c *cgroups) removeOrphans() (removed int, err error) {
	names, err := c.fs.Sweep(ServerCgroupParent, func(name string) bool {
		owner, _, _ := strings.Cut(name, ".")
		pid, err := strconv.Atoi(owner)
		if err != nil {
			return false
		}
		_, alive := boxkit.Stamp(pid)
		return !alive
	})
	return len(names), err
}
