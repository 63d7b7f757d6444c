package jail

import (
	"encoding/binary"
	"fmt"
	"slices"

	llsys "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// zygotePlan is what a forked box does to itself before it runs anything
// of the model's (internal/kernel/zygote.py carries it out). It is
// generated from the box plan (boxpolicy.Plan) that a directly started box's
// init interprets in buildRoot, setRlimits, restrictFS, and from the same
// capabilities and seccomp program as dropPrivileges and loadSeccomp.
type zygotePlan struct {
	// HostID is the box's host uid and gid: the fork becomes it before it
	// creates the box's user namespace, which it then owns, and the maps
	// make it the box's root.
	HostID    int           `json:"host_id"`
	UIDMap    string        `json:"uid_map"`
	GIDMap    string        `json:"gid_map"`
	Hostname  string        `json:"hostname"`
	Mounts    []planMount   `json:"mounts"`
	Rlimits   [][2]uint64   `json:"rlimits"`
	Workspace string        `json:"workspace"`
	UID       int           `json:"uid"`
	GID       int           `json:"gid"`
	SysCapset int           `json:"sys_capset"`
	SysCapget int           `json:"sys_capget"`
	SysClone  int           `json:"sys_clone"`  // the template clones P into the box's namespaces in one step
	AgentCaps uint64        `json:"agent_caps"` // what the box's PID 1 and agent keep
	Landlock  *landlockPlan `json:"landlock,omitempty"`
	Seccomp   []byte        `json:"seccomp"` // raw struct sock_filter array
	Agent     string        `json:"agent"`
	AgentArgs []string      `json:"agent_args"`
	Env       []string      `json:"env"`
	Reseed    string        `json:"reseed"` // Python the fork runs first (sandbox.ReseedCode)
	// CPUs is the box's CPU limit: the thread pools the template stopped
	// get back as many threads as it allows (zygote.py, _rethread).
	CPUs float64 `json:"cpus"`
}

type planMount struct {
	Src      string `json:"src,omitempty"`
	Dst      string `json:"dst"`
	Type     string `json:"type,omitempty"`
	Flags    uint64 `json:"flags"`
	Data     string `json:"data,omitempty"`
	IfExists bool   `json:"if_exists,omitempty"`
}

type landlockPlan struct {
	Handled uint64         `json:"handled"`
	Rules   []landlockRule `json:"rules"`
}

type landlockRule struct {
	Path   string `json:"path"`
	Access uint64 `json:"access"`
}

// directPlan is the plan of a directly started box: its init mounts the
// workspace as root of the box's user namespace, or as the only mapped
// uid, 0, rootless.
func (b *Backend) directPlan(lim sandbox.Limits, env []string) boxpolicy.Plan {
	owner := boxUID
	if b.sharedUID() {
		owner = 0
	}
	return b.withTemplate(boxPlan(lim, owner, env))
}

// templatePlan is the plan of a zygote template: small, since no code runs
// in it, and owned by the template's own host uid (it stays in the host's
// user namespace). Every box forked from it mounts its own (zygotes.plan).
func templatePlan(env []string) boxpolicy.Plan {
	return boxPlan(sandbox.Limits{
		WorkspaceBytes: 1 << 20,
		TmpBytes:       64 << 20, // matplotlib's font cache, built once
		Inodes:         4096,
		Pids:           sandbox.DefaultLimits.Pids,
		OpenFiles:      sandbox.DefaultLimits.OpenFiles,
	}, uidBase, env)
}

// plan is what the box forked from the template into slot does to itself,
// generated from the box plan a directly started box's init interprets
// (boxPlan, never zygote-only): its mounts, rlimits and Landlock rules
// as the raw values zygote.py hands to the kernel.
func (z *zygotes) plan(spec sandbox.Spec, lim sandbox.Limits, slot int) *zygotePlan {
	b := z.b
	host := b.slots.First(slot)
	idMap := fmt.Sprintf("0 %d %d", host, uidRange)
	// Mounted by the box's PID 1, as root of the box's own user
	// namespace: the owner is named there.
	env, _, _ := b.netEnv()
	p := b.withTemplate(boxPlan(lim, boxUID, env))
	return weaken(&zygotePlan{
		HostID:    host,
		UIDMap:    idMap,
		GIDMap:    idMap,
		Hostname:  p.Hostname,
		Mounts:    zygoteMounts(p),
		Rlimits:   zygoteRlimits(p),
		Workspace: p.Workspace,
		UID:       boxUID,
		GID:       boxGID,
		SysCapset: unix.SYS_CAPSET,
		SysCapget: unix.SYS_CAPGET,
		SysClone:  unix.SYS_CLONE,
		AgentCaps: boxkit.CapMask(agentCaps),
		Landlock:  zygoteLandlock(p.Landlock),
		Seccomp:   z.prog,
		Agent:     boxpolicy.AgentPath,
		AgentArgs: b.agentArgs(spec),
		Env:       p.Env,
		Reseed:    sandbox.ReseedCode,
		CPUs:      lim.CPUs,
	})
}

// zygoteMounts are the plan's per-box mounts, in the order the direct
// init makes them (buildRoot): the tmpfs, a fresh /proc with /proc/sys
// read-only, then the masks over /proc.
func zygoteMounts(p boxpolicy.Plan) []planMount {
	const procFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	var mounts []planMount
	for _, t := range p.Tmpfs {
		mounts = append(mounts, planMount{Src: "tmpfs", Dst: t.Path, Type: "tmpfs", Flags: unix.MS_NOSUID | unix.MS_NODEV, Data: t.Options()})
	}
	mounts = append(mounts,
		planMount{Src: "proc", Dst: "/proc", Type: "proc", Flags: procFlags},
		planMount{Src: "/proc/sys", Dst: "/proc/sys", Flags: unix.MS_BIND | unix.MS_REC},
		planMount{Dst: "/proc/sys", Flags: unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | procFlags},
	)
	for _, m := range p.ProcMasks {
		if slices.Contains(p.ProcReadOnly, m) {
			mounts = append(mounts,
				planMount{Src: "/proc/" + m, Dst: "/proc/" + m, Flags: unix.MS_BIND, IfExists: true},
				planMount{Dst: "/proc/" + m, Flags: unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | procFlags, IfExists: true})
			continue
		}
		mounts = append(mounts, planMount{Src: "/dev/null", Dst: "/proc/" + m, Flags: unix.MS_BIND, IfExists: true})
	}
	return mounts
}

// zygoteRlimits are the plan's rlimits as (resource, value) pairs.
func zygoteRlimits(p boxpolicy.Plan) [][2]uint64 {
	out := make([][2]uint64, 0, len(p.Rlimits))
	for _, l := range p.Rlimits {
		res, _ := boxpolicy.RlimitResource(l.Name) // every name of a plan is there: TestPlanRlimitsKnown
		out = append(out, [2]uint64{uint64(res), l.Value})
	}
	return out
}

// Landlock rights as go-landlock's helpers define them, for restrictFS's
// rules under Landlock V5, best effort.
const (
	llRead  = llsys.AccessFSExecute | llsys.AccessFSReadFile | llsys.AccessFSReadDir
	llWrite = llsys.AccessFSWriteFile | llsys.AccessFSRemoveDir | llsys.AccessFSRemoveFile |
		llsys.AccessFSMakeChar | llsys.AccessFSMakeDir | llsys.AccessFSMakeReg | llsys.AccessFSMakeSock |
		llsys.AccessFSMakeFifo | llsys.AccessFSMakeBlock | llsys.AccessFSMakeSym | llsys.AccessFSTruncate
	llFile = llsys.AccessFSExecute | llsys.AccessFSWriteFile | llsys.AccessFSTruncate | llsys.AccessFSReadFile
)

// llSupported is the filesystem rights each Landlock ABI knows, up to V5.
var llSupported = []uint64{0, 1<<13 - 1, 1<<14 - 1, 1<<15 - 1, 1<<15 - 1, 1<<16 - 1}

// llAccess is the rights of each of the plan's kinds of rule, as
// restrictFS grants them through go-landlock.
var llAccess = map[boxpolicy.Access]uint64{
	boxpolicy.ListDir:       llsys.AccessFSReadDir,
	boxpolicy.ReadDir:       llRead,
	boxpolicy.ReadWriteDir:  llRead | llWrite,
	boxpolicy.ReadWriteFile: (llRead | llWrite) & llFile,
}

// zygoteLandlock is the plan's Landlock rules as raw rights of the running
// kernel's ABI; nil when Landlock is absent.
func zygoteLandlock(rules []boxpolicy.PathRule) *landlockPlan {
	abi, err := llsys.LandlockGetABIVersion()
	if err != nil || abi <= 0 {
		return nil
	}
	handled := llSupported[min(abi, len(llSupported)-1)]
	out := make([]landlockRule, 0, len(rules))
	for _, r := range rules {
		out = append(out, landlockRule{Path: r.Path, Access: llAccess[r.Access] & handled})
	}
	return &landlockPlan{Handled: handled, Rules: out}
}

// seccompProgram assembles the box's seccomp program (seccomp.go) into
// the kernel's struct sock_filter array.
func seccompProgram() ([]byte, error) {
	raw, err := seccompRaw()
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, 8*len(raw))
	for _, r := range raw {
		out = binary.NativeEndian.AppendUint16(out, r.Op)
		out = append(out, r.Jt, r.Jf)
		out = binary.NativeEndian.AppendUint32(out, r.K)
	}
	return out, nil
}
