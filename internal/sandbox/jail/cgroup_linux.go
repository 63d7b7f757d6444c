package jail

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

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

// serverGroup is this server's group, the parent of its boxes' groups:
// kiln/<pid>, or kiln/pidns<inode>.<pid> in a pid namespace of its own
// over the host's cgroup tree (nestedPids).
func serverGroup() string { return ServerCgroupParent + "/" + serverName(strconv.Itoa(os.Getpid())) }

// ServerCgroupPattern is the group of a jail server this process starts,
// {pid} standing for the server's pid: serverGroup as that server names
// it, since it shares this process's pid namespace.
func ServerCgroupPattern() string { return ServerCgroupParent + "/" + serverName("{pid}") }

func serverName(pid string) string {
	if ns, nested := nestedPids(); nested {
		return pidnsPrefix + strconv.FormatUint(ns, 10) + "." + pid
	}
	return pid
}

// pidnsPrefix starts the group names of kilns in pid namespaces of their
// own. No pid parses from them, so a kiln in the host's pid namespace
// leaves them alone.
const pidnsPrefix = "pidns"

// The inode numbers of the initial pid and cgroup namespaces, fixed by the
// kernel (include/linux/proc_ns.h).
const (
	initPidNS    = 0xEFFFFFFC
	initCgroupNS = 0xEFFFFFFB
)

// nestedPids reports whether this kiln's pids are not the cgroup tree's:
// it runs in a pid namespace of its own (a container's) and sees the
// host's cgroup tree (cgroup v1, or v2 without a cgroup namespace), which
// kilns in other pid namespaces share. Every container's kiln may be pid
// 1 there, and none can see another's processes: its group is named by
// its pid namespace too, and its sweep judges only its own namespace's
// groups. ns is the pid namespace's inode.
var nestedPids = sync.OnceValues(func() (ns uint64, nested bool) {
	pid, inner := pidNamespace()
	cg := nsInode("cgroup")
	// No cgroup namespace file: a kernel before 4.6, with one tree.
	return pid, inner && (cg == 0 || cg == initCgroupNS)
})

// pidNamespace is the inode of this kiln's pid namespace, and whether it
// is not the host's.
func pidNamespace() (ns uint64, inner bool) {
	ns = nsInode("pid")
	return ns, ns != 0 && ns != initPidNS
}

// stateDirName is the default state directory's name: in a pid namespace
// of its own, a kiln's owner stamps mean nothing to kilns outside it (nor
// theirs to it), so where it shares /tmp with them, their sweeps must not
// meet: the name carries the namespace.
func stateDirName() string {
	if ns, inner := pidNamespace(); inner {
		return "kiln-jail-" + pidnsPrefix + strconv.FormatUint(ns, 10)
	}
	return "kiln-jail"
}

// nsInode is the inode of this process's namespace of kind, or 0.
func nsInode(kind string) uint64 {
	var st unix.Stat_t
	if unix.Stat("/proc/self/ns/"+kind, &st) != nil {
		return 0
	}
	return st.Ino
}

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
// the earlier layout (<pid>.<box id> directly under kiln). A kiln in a
// pid namespace of its own judges only the groups of that namespace: the
// groups a dead container's kiln leaves are empty (its processes went with
// its namespace) and stay. The names carry
// the pid only (bench and tests read this layout), so a reused pid keeps a
// dead server's groups until that process is gone too.
func (c *cgroups) removeOrphans() (removed int, err error) {
	ns, nested := nestedPids()
	own := pidnsPrefix + strconv.FormatUint(ns, 10) + "."
	names, err := c.fs.Sweep(ServerCgroupParent, func(name string) bool {
		if nested {
			// Only this pid namespace's groups: the pids of the
			// others' names are not this kiln's to judge.
			var ok bool
			if name, ok = strings.CutPrefix(name, own); !ok {
				return false
			}
		}
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
