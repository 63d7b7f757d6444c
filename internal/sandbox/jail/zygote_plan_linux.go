package jail

import (
	"encoding/binary"
	"fmt"
	"os"
	"strconv"

	llsys "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"kiln/internal/sandbox"
)

// boxPlan is what a forked box does to itself before it runs anything of
// the model's (internal/kernel/zygote.py carries it out). It is computed
// from the same tables as a directly started box's init: the per-box
// mounts of buildRoot, setRlimits, dropPrivileges, restrictFS and
// seccompFilter.
type boxPlan struct {
	UIDMap    string        `json:"uid_map"`
	GIDMap    string        `json:"gid_map"`
	Hostname  string        `json:"hostname"`
	Mounts    []planMount   `json:"mounts"`
	Rlimits   [][2]uint64   `json:"rlimits"`
	Workspace string        `json:"workspace"`
	UID       int           `json:"uid"`
	GID       int           `json:"gid"`
	SysCapset int           `json:"sys_capset"`
	Landlock  *landlockPlan `json:"landlock,omitempty"`
	Seccomp   []byte        `json:"seccomp"` // raw struct sock_filter array
	Agent     string        `json:"agent"`
	AgentArgs []string      `json:"agent_args"`
	Env       []string      `json:"env"`
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

// procMasks are the files under /proc every box gets /dev/null over.
var procMasks = []string{"sysrq-trigger", "kcore", "timer_list", "keys"}

// devShm is the size and inode cap of every box's /dev/shm.
const (
	devShmBytes  = 64 << 20
	devShmInodes = 1024
)

func (z *zygotes) plan(spec sandbox.Spec, lim sandbox.Limits, slot int) *boxPlan {
	b := z.b
	idMap := fmt.Sprintf("0 %d %d", slot*uidRange, uidRange)
	tmpfsOpts := func(mode string, size int64, inodes, owner int) string {
		s := "mode=" + mode + ",size=" + strconv.FormatInt(size, 10)
		if inodes > 0 {
			s += ",nr_inodes=" + strconv.Itoa(inodes)
		}
		if owner >= 0 {
			s += ",uid=" + strconv.Itoa(owner) + ",gid=" + strconv.Itoa(owner)
		}
		return s
	}
	const tmpfsFlags = unix.MS_NOSUID | unix.MS_NODEV
	const procFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	mounts := []planMount{
		// Mounted before the box has its user namespace: the owner is
		// named in the template's, where the box's uid 0 is slot*uidRange.
		{Src: "tmpfs", Dst: "/work", Type: "tmpfs", Flags: tmpfsFlags, Data: tmpfsOpts("755", lim.WorkspaceBytes, lim.Inodes, slot*uidRange+boxUID)},
		{Src: "tmpfs", Dst: "/tmp", Type: "tmpfs", Flags: tmpfsFlags, Data: tmpfsOpts("1777", lim.TmpBytes, lim.Inodes, -1)},
		{Src: "tmpfs", Dst: "/dev/shm", Type: "tmpfs", Flags: tmpfsFlags, Data: tmpfsOpts("1777", devShmBytes, devShmInodes, -1)},
		{Src: "proc", Dst: "/proc", Type: "proc", Flags: procFlags},
		{Src: "/proc/sys", Dst: "/proc/sys", Flags: unix.MS_BIND | unix.MS_REC},
		{Dst: "/proc/sys", Flags: unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | procFlags},
	}
	for _, p := range procMasks {
		mounts = append(mounts, planMount{Src: "/dev/null", Dst: "/proc/" + p, Flags: unix.MS_BIND, IfExists: true})
	}
	return &boxPlan{
		UIDMap:   idMap,
		GIDMap:   idMap,
		Hostname: "kiln",
		Mounts:   mounts,
		Rlimits: [][2]uint64{
			{unix.RLIMIT_CORE, 0},
			{unix.RLIMIT_NOFILE, uint64(lim.OpenFiles)},
			{unix.RLIMIT_NPROC, uint64(lim.Pids)},
		},
		Workspace: "/work",
		UID:       boxUID,
		GID:       boxGID,
		SysCapset: unix.SYS_CAPSET,
		Landlock:  landlockRules(),
		Seccomp:   z.prog,
		Agent:     "/.kiln/agent",
		AgentArgs: b.agentArgs(spec),
		Env:       b.env(),
	}
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

// landlockRules mirrors restrictFS as data; nil when Landlock is absent.
func landlockRules() *landlockPlan {
	abi, err := llsys.LandlockGetABIVersion()
	if err != nil || abi <= 0 {
		return nil
	}
	handled := llSupported[min(abi, len(llSupported)-1)]
	ro := []string{"/etc", "/proc", "/dev", "/.kiln"}
	for _, d := range runtimeDirs {
		if st, err := os.Lstat(d); err == nil && st.IsDir() {
			ro = append(ro, d)
		}
	}
	var rules []landlockRule
	add := func(access uint64, paths ...string) {
		for _, p := range paths {
			rules = append(rules, landlockRule{Path: p, Access: access & handled})
		}
	}
	add(llRead, ro...)
	add(llsys.AccessFSReadDir, "/")
	add(llRead|llWrite, "/work", "/tmp", "/dev/shm")
	add((llRead|llWrite)&llFile, "/dev/null", "/dev/zero", "/dev/full")
	return &landlockPlan{Handled: handled, Rules: rules}
}

// seccompProgram assembles seccompFilter into the kernel's struct
// sock_filter array.
func seccompProgram() ([]byte, error) {
	f := seccompFilter()
	insts, err := f.Policy.Assemble()
	if err != nil {
		return nil, fmt.Errorf("assembling seccomp policy: %w", err)
	}
	raw, err := bpf.Assemble(insts)
	if err != nil {
		return nil, fmt.Errorf("assembling seccomp program: %w", err)
	}
	out := make([]byte, 0, 8*len(raw))
	for _, r := range raw {
		out = binary.NativeEndian.AppendUint16(out, r.Op)
		out = append(out, r.Jt, r.Jf)
		out = binary.NativeEndian.AppendUint32(out, r.K)
	}
	return out, nil
}
