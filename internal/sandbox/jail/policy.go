package jail

import (
	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
)

// The jail's security policy, as data. Each table has a test that runs a
// victim inside a box and sees it refused (jail_test.go, sandboxtest).

// boxUID and boxGID are the unprivileged user code runs as, inside the box.
// On the host they map to a range no real user has (see uidBase).
const (
	boxUID = boxpolicy.UID
	boxGID = boxpolicy.GID
)

// agentCaps are the capabilities kiln-agent keeps, as root of its box's
// own user namespace (they mean nothing outside it): starting code as boxUID
// (setuid, setgid; and setfsuid, to touch files with the code's rights) and
// signalling it (kill). They reach the agent through its inheritable set
// (a root exec keeps it), with an empty bounding set; the serving agent
// then empties its inheritable set (agent.Harden), so code inherits no
// capability in any set. Code runs as boxUID, so it can neither signal,
// trace nor read the agent; the agent holds no capability over files,
// mounts or the network.
var agentCaps = []uintptr{capSetUID, capSetGID, capKill}

// templateCaps are the capabilities a zygote template keeps, as the
// unprivileged host uid uidBase in the host's user namespace: a fork
// becomes its box's own host uid (setuid, setgid) so that the user
// namespace it creates is owned, and its per-user counts charged, there;
// and the template writes that namespace's id maps, which map box root to
// its owner (setfcap, which the kernel asks for to map the owner as root).
var templateCaps = []uintptr{capSetUID, capSetGID, capSetFCap}

// Capability numbers (linux/capability.h).
const (
	capKill    = 5
	capSetGID  = 6
	capSetUID  = 7
	capSetFCap = 31
)

// The rest of a box's policy (runtime, /etc, mounts, masks, Landlock
// rules, rlimits, environment) is the box plan, package boxpolicy, which the
// init (init_linux.go) and the zygote (zygote_plan_linux.go) interpret.
// The syscall policy (denied syscalls, clone namespace flags, AF_PACKET) is
// shared with the other backends: boxpolicy.SyscallPolicy in
// internal/boxpolicy/syscalls.go, loaded by loadSeccomp (seccomp.go).

// boxPlan is the plan of a box (or a template) with limits l, whose
// workspace belongs to owner, and whose agent gets env.
func boxPlan(l sandbox.Limits, owner int, env []string) boxpolicy.Plan {
	p := l.Plan(owner, owner)
	p.Env = env
	return p
}
