package boxkit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// A process that is not root may make cgroups only in a cgroup v2 subtree
// delegated to its user: under systemd, the user's manager
// (user@<uid>.service, Delegate=yes) and the units it starts own theirs,
// and the controllers the system's manager delegates to it are listed in
// each one's cgroup.controllers. A login session's scope (session-N.scope)
// belongs to root: a process started there must first be moved into one
// of the user's units (systemd-run --user --scope …).
//
// cgroup v2 lets a group enable controllers for its children only while it
// holds no process itself. The process's own cgroup holds it, and usually
// the process that started it (a shell, the agent's client): Delegate moves
// them all into a leaf beside the groups kiln makes, and roots kiln's
// groups at the delegated group.

// delegatedControllers are the controllers a rootless kiln limits boxes with.
var delegatedControllers = []string{"memory", "pids", "cpu"}

// DelegateLeaf is the group under the delegated one that its processes
// move into.
const DelegateLeaf = "leaf"

// DelegationError says why this process has no delegated cgroup subtree,
// and what would give it one.
type DelegationError struct {
	Group   string   // the process's own cgroup, under the v2 root
	Missing []string // controllers that are not delegated to it
	Reason  string   // what is wrong, in words, when it is not only controllers
	Hint    string   // how to get it
}

func (e *DelegationError) Error() string {
	var what string
	switch {
	case e.Reason != "":
		what = e.Reason
	default:
		what = fmt.Sprintf("controllers %s are not delegated to cgroup %s", strings.Join(e.Missing, ", "), e.Group)
	}
	return fmt.Sprintf("%s (%s)", what, e.Hint)
}

// hints for DelegationError.
const (
	hintController = "as root, create /etc/systemd/system/user@.service.d/delegate.conf with \"[Service]\\nDelegate=cpu cpuset io memory pids\", run systemctl daemon-reload, then log out and in again"
	hintScope      = "start kiln in a unit of your own user manager, which owns its cgroup: systemd-run --user --scope --quiet kiln mcp"
	hintV2         = "boot with cgroup v2 alone (systemd.unified_cgroup_hierarchy=1 on the kernel command line); a rootless kiln cannot use cgroup v1"
)

// FindDelegation finds the cgroup of this process (the "0::" line of
// selfCgroup, /proc/self/cgroup's text) under the v2 hierarchy at root and
// checks that it is delegated to uid: its directory and the files that
// move processes and enable controllers belong to uid, and it has memory,
// pids and cpu. It returns the group's path under root.
func FindDelegation(root string, selfCgroup []byte, uid int) (string, error) {
	if !CgroupsAt(root).V2() {
		return "", &DelegationError{Reason: fmt.Sprintf("%s is not a cgroup v2 hierarchy", root), Hint: hintV2}
	}
	group := ""
	for _, line := range strings.Split(string(selfCgroup), "\n") {
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			group = filepath.Clean("/" + rest)
		}
	}
	if group == "" {
		return "", &DelegationError{Reason: "this process is in no cgroup v2 group (no 0:: line in /proc/self/cgroup)", Hint: hintV2}
	}
	dir := filepath.Join(root, group)
	if group == "/" {
		return "", &DelegationError{Group: group, Reason: "this process is in the root cgroup, which only root may divide", Hint: hintScope}
	}
	for _, f := range []string{"", "cgroup.procs", "cgroup.subtree_control"} {
		st, err := os.Stat(filepath.Join(dir, f))
		if err != nil {
			return "", &DelegationError{Group: group, Reason: fmt.Sprintf("reading cgroup %s: %v", group, err), Hint: hintScope}
		}
		if owner := int(st.Sys().(*syscall.Stat_t).Uid); owner != uid {
			return "", &DelegationError{Group: group, Reason: fmt.Sprintf("cgroup %s is not delegated to uid %d (%s belongs to uid %d)", group, uid, filepath.Join(group, f), owner), Hint: hintScope}
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
	if err != nil {
		return "", &DelegationError{Group: group, Reason: fmt.Sprintf("reading controllers of cgroup %s: %v", group, err), Hint: hintScope}
	}
	have := strings.Fields(string(b))
	var missing []string
	for _, c := range delegatedControllers {
		if !slices.Contains(have, c) {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return "", &DelegationError{Group: group, Missing: missing, Hint: hintController}
	}
	return group, nil
}

// Delegate makes the group at path under the v2 hierarchy at root (one
// FindDelegation accepted) the root of the groups kiln makes: it moves
// every process in it into DelegateLeaf, enables memory, pids and cpu for
// its children, and returns it as a cgroup filesystem of its own. Called
// again (another backend of this process), it finds the work done.
func Delegate(root, path string) (*Cgroups, error) {
	dir := filepath.Join(root, path)
	leaf := filepath.Join(dir, DelegateLeaf)
	if err := os.Mkdir(leaf, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("creating cgroup leaf %s: %w", leaf, err)
	}
	// Processes may start in the group while we move them (a client
	// forking): go round until it is empty.
	for round := 0; ; round++ {
		pids := cgroupReadProcs(dir)
		if len(pids) == 0 {
			break
		}
		if round == 10 {
			return nil, fmt.Errorf("moving processes into cgroup leaf %s: %v are still in %s", leaf, pids, dir)
		}
		for _, pid := range pids {
			err := os.WriteFile(filepath.Join(leaf, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
			if err != nil && !errors.Is(err, syscall.ESRCH) {
				return nil, fmt.Errorf("moving process %d into cgroup leaf %s: %w", pid, leaf, err)
			}
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte(cgroupV2Controllers), 0); err != nil {
		return nil, fmt.Errorf("enabling controllers in %s: %w", dir, err)
	}
	return &Cgroups{root: dir, v2: true}, nil
}

// DelegatedCgroups is the cgroup subtree delegated to this process's
// user, made ready for kiln's groups (FindDelegation, then Delegate).
func DelegatedCgroups() (*Cgroups, error) {
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, fmt.Errorf("reading own cgroup: %w", err)
	}
	path, err := FindDelegation(CgroupRoot, self, os.Getuid())
	if err != nil {
		return nil, err
	}
	return Delegate(CgroupRoot, path)
}
