package gvisor

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// A box's paths, runtime, /etc, tmpfs sizes, rlimits and environment are
// the box plan (package boxpolicy), the jail's too; buildSpec renders it as
// OCI, buildHostRoot writes its /etc.

// agentCaps are the capabilities of kiln-agent, the box's first process,
// which runs as root of the box so that code (started as the box's user)
// cannot signal it, ptrace it, or reopen its stream through /proc: setuid
// and setgid to start code as that user, kill to stop and interrupt it, and
// chown and dac_override for the file tools, which read what code keeps
// private and give what they write to code's user. Code starts with none:
// the change of uid clears them, no_new_privs keeps them off.
var agentCaps = []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"}

// boxConfig is what one box's OCI spec is made from.
type boxConfig struct {
	Root       string // root directory on the host
	Agent      string // kiln-agent on the host
	HostDirs   []hostDir
	Limits     sandbox.Limits // with defaults applied
	Preload    []string
	UID, GID   uint32 // the code's user; the agent runs as root of the box
	CgroupPath string
	Template   string  // host directory bound at boxpolicy.TemplateDir; "": none
	TemplateRW bool    // writable: the template's setup
	Net        *boxNet // the box's way to the egress gateway; nil: loopback only
}

// boxNet is a box's way to the egress gateway: a network namespace the
// gateway made and wired (runsc joins it and takes its interface into the
// box's netstack), and what points the box's clients at the gateway.
type boxNet struct {
	NetNS      string   // path of the network namespace
	ResolvConf string   // host file bound read-only at /etc/resolv.conf
	Trust      string   // host file bound read-only at boxpolicy.TrustBundle; "": none
	Env        []string // the proxy variables, and the trust bundle's with Trust
}

// hostDir is a host directory bound read-only at the same path.
type hostDir struct{ Path string }

// hostPidsSlack is added to the box's pids limit for the host cgroup, which
// counts the gVisor sandbox's own host threads and its systrap stubs, not
// the tasks inside the box; the box's own task limit is RLIMIT_NPROC, which
// the gVisor kernel enforces.
const hostPidsSlack = 256

// sentryMemSlack is added to the box's memory limit for the host cgroup,
// which is charged for the gVisor kernel's own memory as well as the box's.
// gVisor has no OOM killer of its own: a box that goes over its cgroup
// limit dies whole (the host kills the sandbox process).
const sentryMemSlack = 64 << 20

// buildSpec returns the OCI spec of a box. Everything that is not the same
// for two boxes of the same template (cgroup path, resources) is allowed by
// runsc to differ between checkpoint and restore.
func buildSpec(c boxConfig) *specs.Spec {
	l := c.Limits
	plan := l.Plan(int(c.UID), int(c.GID))
	// -preload always: the agent's own default is not the Spec's. The
	// agent runs as root of the box and starts code as the box's user.
	args := []string{boxpolicy.AgentPath, "-workspace=" + plan.Workspace, "-preload=" + strings.Join(c.Preload, ","),
		"-uid=" + strconv.FormatUint(uint64(c.UID), 10), "-gid=" + strconv.FormatUint(uint64(c.GID), 10)}
	roBind := []string{"rbind", "ro", "nosuid", "nodev"}
	tmpfs := map[string]specs.Mount{}
	for _, t := range plan.Tmpfs {
		tmpfs[t.Path] = tmpfsMount(t)
	}
	shm := tmpfs[boxpolicy.DevShm]
	shm.Options = append(shm.Options, "noexec")
	mounts := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
		shm,
		{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
	}
	for _, d := range c.HostDirs {
		mounts = append(mounts, specs.Mount{Destination: d.Path, Type: "bind", Source: d.Path, Options: roBind})
	}
	mounts = append(mounts,
		specs.Mount{Destination: boxpolicy.AgentPath, Type: "bind", Source: c.Agent, Options: roBind},
		tmpfs[boxpolicy.Workspace], tmpfs[boxpolicy.Tmp])
	mounts = append(mounts, templateMounts(c)...)
	netns := specs.LinuxNamespace{Type: specs.NetworkNamespace}
	env := append(append(slices.Clone(plan.Env), boxpolicy.UserEnv(int(c.UID))...), templateEnv(c)...)
	if n := c.Net; n != nil {
		netns.Path = n.NetNS
		mounts = append(mounts, specs.Mount{Destination: "/etc/resolv.conf", Type: "bind", Source: n.ResolvConf, Options: roBind})
		if n.Trust != "" {
			mounts = append(mounts, specs.Mount{Destination: boxpolicy.TrustBundle, Type: "bind", Source: n.Trust, Options: roBind})
		}
		env = append(env, n.Env...)
	}
	var rlimits []specs.POSIXRlimit
	for _, r := range plan.Rlimits {
		rlimits = append(rlimits, specs.POSIXRlimit{Type: r.Name, Hard: r.Value, Soft: r.Value})
	}
	period := uint64(100000)
	quota := int64(l.CPUs * float64(period))
	pids := int64(l.Pids) + hostPidsSlack
	mem := l.MemoryBytes + sentryMemSlack
	return &specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{
			Terminal: false,
			User:     specs.User{UID: 0, GID: 0},
			Args:     args,
			Env:      env,
			Cwd:      plan.Workspace,
			Capabilities: &specs.LinuxCapabilities{
				Bounding:  agentCaps,
				Effective: agentCaps,
				Permitted: agentCaps,
			},
			Rlimits:         rlimits,
			NoNewPrivileges: true,
		},
		Root:     &specs.Root{Path: c.Root, Readonly: true},
		Hostname: plan.Hostname,
		Mounts:   mounts,
		Linux: &specs.Linux{
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, netns, {Type: specs.IPCNamespace},
				{Type: specs.UTSNamespace}, {Type: specs.MountNamespace},
			},
			Resources: &specs.LinuxResources{
				Memory: &specs.LinuxMemory{Limit: &mem},
				Pids:   &specs.LinuxPids{Limit: pids},
				CPU:    &specs.LinuxCPU{Quota: &quota, Period: &period},
			},
			CgroupsPath:   c.CgroupPath,
			Seccomp:       Seccomp(),
			MaskedPaths:   maskedPaths(plan),
			ReadonlyPaths: []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"},
		},
	}
}

// maskedPaths are the plan's masks over /proc, and /sys/firmware.
func maskedPaths(p boxpolicy.Plan) []string {
	var out []string
	for _, m := range p.ProcMasks {
		out = append(out, "/proc/"+m)
	}
	return append(out, "/sys/firmware")
}

// tmpfsMount is one of the plan's tmpfs, without its inode cap, which
// gVisor's tmpfs refuses.
func tmpfsMount(t boxpolicy.Tmpfs) specs.Mount {
	opts := []string{"nosuid", "nodev", "mode=" + t.Mode}
	if t.UID >= 0 {
		opts = append(opts, "uid="+strconv.Itoa(t.UID), "gid="+strconv.Itoa(t.GID))
	}
	return specs.Mount{Destination: t.Path, Type: "tmpfs", Source: "tmpfs", Options: append(opts, "size="+strconv.FormatInt(t.Size, 10))}
}

// Seccomp is the OCI seccomp section of every gVisor box: the box's
// syscall policy (boxpolicy.SyscallPolicy, the jail's too) rendered by
// boxkit.OCISeccomp rule for rule, since runsc, like the jail's filter,
// takes the first rule of a syscall that matches. gVisor's kernel applies
// it to the box's processes; runsc reads it only with --oci-seccomp. The
// host kernel never sees these syscalls, but each refused one is a part of
// the sentry the box cannot reach (its user and mount namespaces,
// io_uring, keys, other socket families). What the policy makes absent
// (clone3, and every syscall it does not name) fails with ENOSYS, so libc
// falls back from clone3 to clone(2), where the namespace flags are
// visible. An i386 (int 0x80) or x32-numbered call ends in ENOSYS under
// gVisor (the hostile battery checks both), and runsc's program kills a
// thread whose call claims another architecture.
func Seccomp() *specs.LinuxSeccomp {
	return boxkit.OCISeccomp(boxpolicy.SyscallPolicy, boxkit.FirstMatch)
}

// templateKey names the checkpoint a box can be restored from: the parts of
// its spec runsc requires to be equal on both sides (it lets the root path,
// cgroup path and resources differ), plus what else shapes the image.
func templateKey(s *specs.Spec, extra ...string) string {
	c := *s
	c.Root = &specs.Root{Readonly: s.Root.Readonly}
	lin := *s.Linux
	lin.Resources, lin.CgroupsPath = nil, ""
	c.Linux = &lin
	b, err := json.Marshal(&c)
	if err != nil {
		panic(fmt.Sprintf("encoding spec: %v", err)) // plain data; cannot fail
	}
	h := sha256.New()
	h.Write(b)
	for _, e := range extra {
		h.Write([]byte{0})
		h.Write([]byte(e))
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// containerID turns a sandbox ID into a runsc container ID (letters, digits,
// "_+.-").
func containerID(id string) string {
	var b strings.Builder
	b.WriteString("kiln-")
	for _, r := range id {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '_', r == '.', r == '-', r == '+':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	return b.String()
}
