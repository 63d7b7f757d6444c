// Package guestinit prepares a microVM guest when kiln-agent runs as its
// PID 1: mounts, the workspace tmpfs, the host stream device. It runs inside
// the box and imports no host-side code (only the standard library and
// golang.org/x/sys).
//
// A guest boots in two stages, both run by the same kiln-agent binary:
//
//  1. In the initramfs (the root is a ramfs), Setup loads the kernel modules
//     listed in ModulesFile, mounts the root disk read-only, switches root to
//     it and re-executes AgentPath with the same arguments. It does not
//     return when this works.
//  2. On the real root, Setup mounts /proc, /sys, /dev, the size-capped
//     workspace and /tmp, sets the hostname, brings up lo and returns the
//     path of the virtio-serial port named PortName.
//
// The host passes sizes and names on the kernel command line as kiln.*
// parameters (see Params); fields set in Config win over them.
package guestinit

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"kiln/internal/sandbox/boxplan"
)

// Names shared with the host side (package image and the microvm driver).
const (
	// AgentPath is where kiln-agent lives in the root filesystem.
	AgentPath = "/sbin/kiln-agent"
	// ModulesFile lists, one per line and in load order, the kernel
	// modules (paths inside the initramfs) that stage 1 loads.
	ModulesFile = "/etc/kiln/modules"
	// PortName is the virtio-serial port name the host gives the agent's
	// stream (-device virtserialport,name=kiln.agent).
	PortName = "kiln.agent"
	// CodeCgroup is the cgroup (v2) for the code the agent runs: the
	// box's memory and pids limits apply to it, not to the agent, so the
	// guest's OOM killer picks a process of the code. The agent starts
	// the kernel and shells in it (SysProcAttr.UseCgroupFD).
	CodeCgroup = "/sys/fs/cgroup/code"
)

// SeedPortName is the virtio-serial port on which the host sends a fresh
// seed after restoring a clone: SeedSize bytes of entropy, then the host's
// wall-clock time as 8 bytes of big-endian Unix nanoseconds. Every clone
// of a template starts with the template's random state and clock; QEMU's
// microvm has no VM generation ID to tell the kernel. PID 1 mixes the
// entropy into the kernel's pool, forces a reseed, sets the clock, and
// answers one byte, so the host hands the box out only after.
const SeedPortName = "kiln.seed"

// SeedVsockPort is the seed port of a guest whose agent talks vsock
// (Firecracker): the same messages and answers, one host connection per
// restore.
const SeedVsockPort = 1023

// SeedSize is the entropy in a seed message; SeedMessageSize the whole.
const (
	SeedSize        = 32
	SeedMessageSize = SeedSize + 8
)

// ErrUnsupported is returned on operating systems other than Linux.
var ErrUnsupported = errors.New("guestinit: not supported on this OS")

// Config is what the agent passes to Setup. Zero fields are taken from the
// kernel command line, then from the defaults.
type Config struct {
	Workspace      string // where the size-capped workspace tmpfs goes, e.g. /work
	WorkspaceBytes int64  // size of the workspace tmpfs
	TmpBytes       int64  // size of /tmp
	Inodes         int64  // files in the workspace and in /tmp, each
	UID, GID       int    // owner of the workspace (the user that runs code)
	Hostname       string
	Pids           int   // RLIMIT_NPROC inherited by the code's processes
	OpenFiles      int   // RLIMIT_NOFILE
	MemoryBytes    int64 // memory.max of CodeCgroup
}

// Params are the kiln.* kernel command line parameters the host sets.
type Params struct {
	WorkspaceBytes int64  // kiln.work_size
	TmpBytes       int64  // kiln.tmp_size
	Inodes         int64  // kiln.inodes
	UID, GID       int    // kiln.uid, kiln.gid
	Hostname       string // kiln.hostname
	Pids           int    // kiln.pids
	OpenFiles      int    // kiln.nofile
	MemoryBytes    int64  // kiln.mem
	Port           string // kiln.port: the virtio-serial port name
	Transport      string // kiln.transport: "serial" (virtio-serial) or "vsock"
	VsockPort      uint32 // kiln.vsock_port: where the agent listens with vsock
	Root           string // root= (stage 1)
	RootFSType     string // rootfstype= (stage 1)
}

// Defaults used when neither Config nor the command line says.
var defaults = Params{
	WorkspaceBytes: 512 << 20,
	TmpBytes:       256 << 20,
	Inodes:         65536,
	UID:            1000,
	GID:            1000,
	Hostname:       "kiln",
	Pids:           256,
	OpenFiles:      1024,
	MemoryBytes:    1 << 30,
	Port:           PortName,
	Transport:      "serial",
	VsockPort:      1024,
	Root:           "/dev/vda",
	RootFSType:     "ext4",
}

// DefaultParams are the parameters of a command line that sets none.
func DefaultParams() Params { return defaults }

// cmdlineParams are the command-line keys of Params, each with how its
// value is written (the host, Cmdline) and read (the guest, ParseCmdline):
// one table, so the two sides cannot drift apart. A reader returns false
// for a value it does not take; the field keeps its default.
var cmdlineParams = []struct {
	key   string
	write func(*Params) string
	read  func(*Params, string) bool
}{
	{"root", func(p *Params) string { return p.Root }, func(p *Params, v string) bool { p.Root = v; return true }},
	{"rootfstype", func(p *Params) string { return p.RootFSType }, func(p *Params, v string) bool { p.RootFSType = v; return true }},
	{"kiln.work_size", func(p *Params) string { return itoa(p.WorkspaceBytes) }, func(p *Params, v string) bool { return setSize(&p.WorkspaceBytes, v) }},
	{"kiln.tmp_size", func(p *Params) string { return itoa(p.TmpBytes) }, func(p *Params, v string) bool { return setSize(&p.TmpBytes, v) }},
	{"kiln.inodes", func(p *Params) string { return itoa(p.Inodes) }, func(p *Params, v string) bool { return setSize(&p.Inodes, v) }},
	{"kiln.mem", func(p *Params) string { return itoa(p.MemoryBytes) }, func(p *Params, v string) bool { return setSize(&p.MemoryBytes, v) }},
	{"kiln.pids", func(p *Params) string { return itoa(p.Pids) }, func(p *Params, v string) bool { return setInt(&p.Pids, v) }},
	{"kiln.nofile", func(p *Params) string { return itoa(p.OpenFiles) }, func(p *Params, v string) bool { return setInt(&p.OpenFiles, v) }},
	{"kiln.uid", func(p *Params) string { return itoa(p.UID) }, func(p *Params, v string) bool { return setInt(&p.UID, v) }},
	{"kiln.gid", func(p *Params) string { return itoa(p.GID) }, func(p *Params, v string) bool { return setInt(&p.GID, v) }},
	{"kiln.hostname", func(p *Params) string { return escape(p.Hostname) }, func(p *Params, v string) bool {
		v, ok := unescape(v)
		if ok = ok && validHostname(v); ok {
			p.Hostname = v
		}
		return ok
	}},
	{"kiln.port", func(p *Params) string { return escape(p.Port) }, func(p *Params, v string) bool {
		v, ok := unescape(v)
		if ok = ok && v != ""; ok {
			p.Port = v
		}
		return ok
	}},
	{"kiln.transport", func(p *Params) string { return p.Transport }, func(p *Params, v string) bool {
		ok := v == "serial" || v == "vsock"
		if ok {
			p.Transport = v
		}
		return ok
	}},
	{"kiln.vsock_port", func(p *Params) string { return itoa(p.VsockPort) }, func(p *Params, v string) bool {
		n, err := strconv.ParseUint(v, 10, 32)
		if err == nil {
			p.VsockPort = uint32(n)
		}
		return err == nil
	}},
}

// Cmdline is p as kernel command-line words, which ParseCmdline reads
// back as p when Validate accepts it. Strings the guest reads are
// escaped, so that no value can end its word and start another (a
// parameter, or init's arguments after "--").
func (p Params) Cmdline() []string {
	w := make([]string, 0, len(cmdlineParams))
	for _, c := range cmdlineParams {
		w = append(w, c.key+"="+c.write(&p))
	}
	return w
}

// Validate reports a value ParseCmdline would not read back from
// Cmdline: the guest would use the default instead.
func (p Params) Validate() error {
	for _, c := range cmdlineParams {
		v := c.write(&p)
		var q Params
		if v == "" || strings.ContainsAny(v, " \t\n\"") || !c.read(&q, v) {
			return fmt.Errorf("invalid %s %q", c.key, v)
		}
	}
	return nil
}

// ParseCmdline reads the parameters kiln cares about from a kernel command
// line (the contents of /proc/cmdline). Unknown words are ignored; missing
// or malformed values keep their defaults. Everything after "--" belongs to
// init and is ignored.
func ParseCmdline(cmdline string) Params {
	p := defaults
	for _, w := range strings.Fields(cmdline) {
		if w == "--" {
			break
		}
		k, v, ok := strings.Cut(w, "=")
		if !ok || v == "" {
			continue
		}
		for _, c := range cmdlineParams {
			if c.key == k {
				c.read(&p, v)
			}
		}
	}
	return p
}

func itoa[T int | int64 | uint32](n T) string { return strconv.FormatInt(int64(n), 10) }

// escape percent-encodes s (spaces, quotes, "%" and the like), which the
// kernel would otherwise split or interpret.
func escape(s string) string { return url.PathEscape(s) }

func unescape(s string) (string, bool) {
	v, err := url.PathUnescape(s)
	return v, err == nil
}

func setSize(dst *int64, v string) bool {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return false
	}
	*dst = n
	return true
}

func setInt(dst *int, v string) bool {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return false
	}
	*dst = n
	return true
}

func validHostname(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.') {
			return false
		}
	}
	return true
}

// merge fills zero fields of cfg from p.
func (cfg Config) merge(p Params) Config {
	if cfg.Workspace == "" {
		cfg.Workspace = boxplan.Workspace
	}
	if cfg.WorkspaceBytes == 0 {
		cfg.WorkspaceBytes = p.WorkspaceBytes
	}
	if cfg.TmpBytes == 0 {
		cfg.TmpBytes = p.TmpBytes
	}
	if cfg.Inodes == 0 {
		cfg.Inodes = p.Inodes
	}
	if cfg.UID == 0 && cfg.GID == 0 {
		cfg.UID, cfg.GID = p.UID, p.GID
	}
	if cfg.Hostname == "" {
		cfg.Hostname = p.Hostname
	}
	if cfg.Pids == 0 {
		cfg.Pids = p.Pids
	}
	if cfg.OpenFiles == 0 {
		cfg.OpenFiles = p.OpenFiles
	}
	if cfg.MemoryBytes == 0 {
		cfg.MemoryBytes = p.MemoryBytes
	}
	return cfg
}

// mount is one filesystem Setup mounts. The table is data so it can be
// read, reviewed and tested in one place.
type mount struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
}

// Mount flags, mirrored here so the table builds on every OS.
const (
	msRdonly uintptr = 0x1
	msNosuid uintptr = 0x2
	msNodev  uintptr = 0x4
	msNoexec uintptr = 0x8
)

// mounts returns what stage 2 mounts, in order.
func mounts(cfg Config) []mount {
	return []mount{
		// hidepid=2: code running as the unprivileged user cannot see
		// the agent's processes.
		{"proc", "/proc", "proc", msNosuid | msNodev | msNoexec, "hidepid=2"},
		{"sysfs", "/sys", "sysfs", msNosuid | msNodev | msNoexec | msRdonly, ""},
		{"devtmpfs", "/dev", "devtmpfs", msNosuid | msNoexec, "mode=0755"},
		{"devpts", "/dev/pts", "devpts", msNosuid | msNoexec, "newinstance,ptmxmode=0666,mode=0620"},
		{"tmpfs", "/dev/shm", "tmpfs", msNosuid | msNodev, fmt.Sprintf("mode=1777,size=%d", min(cfg.TmpBytes, boxplan.DevShmBytes))},
		{"tmpfs", "/tmp", "tmpfs", msNosuid | msNodev, fmt.Sprintf("mode=1777,size=%d,nr_inodes=%d", cfg.TmpBytes, cfg.Inodes)},
		{"tmpfs", "/run", "tmpfs", msNosuid | msNodev | msNoexec, "mode=0755,size=1048576"},
		{"tmpfs", cfg.Workspace, "tmpfs", msNosuid | msNodev, fmt.Sprintf("mode=0755,size=%d,nr_inodes=%d,uid=%d,gid=%d", cfg.WorkspaceBytes, cfg.Inodes, cfg.UID, cfg.GID)},
	}
}

// sysctls harden the guest kernel once boot is done. The VM is the
// boundary; these keep the code's view of its own kernel narrow, as the
// jail backend's seccomp does on the host: no user namespaces (so no
// unshare, mount or chroot for the unprivileged user), no module loading,
// no kernel pointers or log, no unprivileged BPF or perf.
var sysctls = []struct{ key, value string }{
	{"user/max_user_namespaces", "0"},
	{"kernel/unprivileged_userns_clone", "0"}, // Debian's switch; absent elsewhere
	{"kernel/unprivileged_bpf_disabled", "1"},
	{"kernel/perf_event_paranoid", "3"},
	{"kernel/kptr_restrict", "2"},
	{"kernel/dmesg_restrict", "1"},
	{"kernel/sysrq", "0"},
	{"kernel/modules_disabled", "1"}, // last: stage 1 loaded all we need
}

// codeCgroupFiles are written into CodeCgroup, in order.
func codeCgroupFiles(cfg Config) []struct{ file, value string } {
	return []struct{ file, value string }{
		{"memory.max", fmt.Sprint(cfg.MemoryBytes)},
		{"memory.swap.max", "0"},
		{"pids.max", fmt.Sprint(cfg.Pids)},
	}
}

// ParseModules reads ModulesFile: one module path a line, # comments.
func ParseModules(s string) []string {
	var out []string
	for _, line := range strings.Split(s, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		out = append(out, line)
	}
	return out
}
