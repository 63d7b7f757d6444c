package gvisor

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"syscall"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/sandbox"
)

// Paths inside every box.
const (
	agentPath = "/.kiln/kiln-agent" // the agent binary, bound read-only
	workDir   = "/work"             // the workspace: a size-capped tmpfs
	tmpDir    = "/tmp"
)

// hostRuntimeDirs are the host directories a box built from the host runtime
// sees, read-only. A directory that is a symlink on the host (usrmerge) is a
// symlink in the box too.
var hostRuntimeDirs = []string{"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"}

// hostEtc lists the host /etc entries copied into a host-runtime box's own
// /etc: what the dynamic loader, python and its common libraries read, and
// nothing that holds a secret. numpy finds its BLAS through alternatives;
// matplotlib reads matplotlibrc and fontconfig. Symlinks are copied as
// links, never followed.
var hostEtc = []string{
	"ld.so.cache", "ld.so.conf", "ld.so.conf.d",
	"alternatives",
	"fonts", "matplotlibrc",
	"mime.types", "localtime", "timezone",
	"ssl/certs", "ssl/openssl.cnf", "ca-certificates.conf",
	"python3", "python3.11", "python3.12", "python3.13",
}

// synthEtc is written into a host-runtime box's /etc instead of the host's.
// The box's user is added to passwd and group when it is not nobody.
var synthEtc = map[string]string{
	"passwd":        "root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/work:/usr/sbin/nologin\n",
	"group":         "root:x:0:\nnogroup:x:65534:\n",
	"hosts":         "127.0.0.1\tlocalhost kiln\n::1\tlocalhost ip6-localhost ip6-loopback\n",
	"hostname":      "kiln\n",
	"nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
	"resolv.conf":   "",
}

// boxConfig is what one box's OCI spec is made from.
type boxConfig struct {
	Root       string // root directory on the host
	Agent      string // kiln-agent on the host
	HostDirs   []hostDir
	Limits     sandbox.Limits // with defaults applied
	Preload    []string
	UID, GID   uint32
	CgroupPath string
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
	// -preload always: the agent's own default is not the Spec's.
	args := []string{agentPath, "-workspace=" + workDir, "-preload=" + strings.Join(c.Preload, ",")}
	roBind := []string{"rbind", "ro", "nosuid", "nodev"}
	mounts := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=" + strconv.FormatInt(l.TmpBytes, 10)}},
		{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
	}
	for _, d := range c.HostDirs {
		mounts = append(mounts, specs.Mount{Destination: d.Path, Type: "bind", Source: d.Path, Options: roBind})
	}
	mounts = append(mounts,
		specs.Mount{Destination: agentPath, Type: "bind", Source: c.Agent, Options: roBind},
		specs.Mount{Destination: workDir, Type: "tmpfs", Source: "tmpfs", Options: []string{
			"nosuid", "nodev", "mode=0755",
			"uid=" + strconv.FormatUint(uint64(c.UID), 10), "gid=" + strconv.FormatUint(uint64(c.GID), 10),
			"size=" + strconv.FormatInt(l.WorkspaceBytes, 10)}},
		specs.Mount{Destination: tmpDir, Type: "tmpfs", Source: "tmpfs", Options: []string{
			"nosuid", "nodev", "mode=1777", "size=" + strconv.FormatInt(l.TmpBytes, 10)}},
	)
	period := uint64(100000)
	quota := int64(l.CPUs * float64(period))
	pids := int64(l.Pids) + hostPidsSlack
	mem := l.MemoryBytes + sentryMemSlack
	return &specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{
			Terminal: false,
			User:     specs.User{UID: c.UID, GID: c.GID},
			Args:     args,
			Env: []string{
				"PATH=/usr/local/bin:/usr/bin:/bin",
				"HOME=" + workDir,
				"TMPDIR=" + tmpDir,
				"LANG=C.UTF-8",
				"MPLBACKEND=Agg",
			},
			Cwd:          workDir,
			Capabilities: &specs.LinuxCapabilities{},
			Rlimits: []specs.POSIXRlimit{
				{Type: "RLIMIT_NOFILE", Hard: uint64(l.OpenFiles), Soft: uint64(l.OpenFiles)},
				{Type: "RLIMIT_NPROC", Hard: uint64(l.Pids), Soft: uint64(l.Pids)},
				{Type: "RLIMIT_CORE", Hard: 0, Soft: 0},
			},
			NoNewPrivileges: true,
		},
		Root:     &specs.Root{Path: c.Root, Readonly: true},
		Hostname: "kiln",
		Mounts:   mounts,
		Linux: &specs.Linux{
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.NetworkNamespace}, {Type: specs.IPCNamespace},
				{Type: specs.UTSNamespace}, {Type: specs.MountNamespace},
			},
			Resources: &specs.LinuxResources{
				Memory: &specs.LinuxMemory{Limit: &mem},
				Pids:   &specs.LinuxPids{Limit: pids},
				CPU:    &specs.LinuxCPU{Quota: &quota, Period: &period},
			},
			CgroupsPath:   c.CgroupPath,
			Seccomp:       seccompSpec(),
			MaskedPaths:   []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"},
			ReadonlyPaths: []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"},
		},
	}
}

// seccompSpec is the box's syscall policy (sandbox.DeniedSyscalls and the
// rest, the jail's too) as an OCI seccomp section. gVisor's kernel applies
// it to the box's processes; runsc reads it only with --oci-seccomp. The
// host kernel never sees these syscalls, but each refused one is a part of
// the sentry the box cannot reach (its user and mount namespaces, io_uring,
// keys).
//
// runsc answers every SCMP_ACT_ERRNO with EPERM whatever errnoRet says, so
// the absent syscalls (clone3) take SCMP_ACT_TRACE instead: with no tracer
// the syscall fails with ENOSYS, and there is none, since ptrace is denied.
// libc then falls back to clone(2), where the namespace flags are visible.
func seccompSpec() *specs.LinuxSeccomp {
	eperm := uint(syscall.EPERM)
	sys := []specs.LinuxSyscall{{Names: sandbox.DeniedSyscalls, Action: specs.ActErrno, ErrnoRet: &eperm}}
	// One rule per flag: runsc ANDs the conditions of one rule.
	for _, flag := range sandbox.DeniedCloneFlags {
		sys = append(sys, specs.LinuxSyscall{Names: []string{"clone"}, Action: specs.ActErrno, ErrnoRet: &eperm,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: flag, ValueTwo: flag, Op: specs.OpMaskedEqual}}})
	}
	sys = append(sys,
		specs.LinuxSyscall{Names: []string{"socket"}, Action: specs.ActErrno, ErrnoRet: &eperm,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: sandbox.AFPacket, Op: specs.OpEqualTo}}},
		specs.LinuxSyscall{Names: sandbox.AbsentSyscalls, Action: specs.ActTrace},
	)
	return &specs.LinuxSeccomp{
		DefaultAction: specs.ActAllow,
		Architectures: []specs.Arch{specs.ArchX86_64, specs.ArchAARCH64},
		Syscalls:      sys,
	}
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
