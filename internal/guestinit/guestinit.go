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
//  2. On the real root, Setup mounts /proc, /sys and /dev, then builds
//     the box from the box plan the host put on the kernel command line
//     (PlanParam): its size-capped tmpfs mounts, /proc masks, rlimits,
//     environment and host name; it brings up lo and returns the path of
//     the virtio-serial port named PortName.
//
// The host passes the plan and the guest's wiring on the kernel command
// line as kiln.* parameters (see Params). A command line without a plan
// fails the boot (ErrNoPlan); the guest has no box of its own.
package guestinit

import (
	"bytes"
	"compress/flate"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"kiln/internal/boxpolicy"
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
// seed after restoring a clone (a Seed). Every clone of a template starts
// with the template's random state and clock; QEMU's microvm has no VM
// generation ID to tell the kernel. PID 1 mixes the entropy into the
// kernel's pool, forces a reseed, sets the clock, gives a box with a
// network (boxpolicy.Plan.Network) its address, and answers one byte
// (SeedOK, or SeedFailed when it could not configure the network), so the
// host hands the box out only after.
const SeedPortName = "kiln.seed"

// SeedVsockPort is the seed port of a guest whose agent talks vsock
// (Firecracker): the same messages and answers, one host connection per
// restore.
const SeedVsockPort = 1023

// SeedSize is the entropy in a seed message; SeedHeaderSize its fixed
// part: the entropy, the host's wall-clock time (8 bytes of big-endian
// Unix nanoseconds), the box's IPv4 address (4 bytes, zero for none) and
// the length of the trust bundle that follows (4 bytes, big-endian).
const (
	SeedSize       = 32
	SeedHeaderSize = SeedSize + 8 + 4 + 4
	// MaxTrustBundle bounds the trust bundle of a seed: the host's roots
	// and the gateway's CA are a few hundred KiB.
	MaxTrustBundle = 4 << 20
)

// Answers to a seed message.
const (
	SeedOK     = 1
	SeedFailed = 0
)

// Seed is one seed message.
type Seed struct {
	Entropy [SeedSize]byte
	Time    int64   // Unix nanoseconds
	Addr    [4]byte // the box's address on its /32; zero: no network
	// TrustBundle is the CA bundle the box trusts (boxpolicy.TrustBundle),
	// for a network whose plan says it has one.
	TrustBundle []byte
}

// Marshal is s on the wire.
func (s Seed) Marshal() []byte {
	b := make([]byte, SeedHeaderSize, SeedHeaderSize+len(s.TrustBundle))
	copy(b, s.Entropy[:])
	binary.BigEndian.PutUint64(b[SeedSize:], uint64(s.Time))
	copy(b[SeedSize+8:], s.Addr[:])
	binary.BigEndian.PutUint32(b[SeedSize+12:], uint32(len(s.TrustBundle)))
	return append(b, s.TrustBundle...)
}

// ReadSeed reads one seed message; it refuses a trust bundle over
// MaxTrustBundle.
func ReadSeed(r io.Reader) (Seed, error) {
	var s Seed
	h := make([]byte, SeedHeaderSize)
	if _, err := io.ReadFull(r, h); err != nil {
		return s, err
	}
	copy(s.Entropy[:], h)
	s.Time = int64(binary.BigEndian.Uint64(h[SeedSize:]))
	copy(s.Addr[:], h[SeedSize+8:])
	n := binary.BigEndian.Uint32(h[SeedSize+12:])
	if n > MaxTrustBundle {
		return s, fmt.Errorf("reading seed: trust bundle of %d bytes, over %d", n, MaxTrustBundle)
	}
	if n > 0 {
		s.TrustBundle = make([]byte, n)
		if _, err := io.ReadFull(r, s.TrustBundle); err != nil {
			return s, err
		}
	}
	return s, nil
}

// ErrUnsupported is returned on operating systems other than Linux.
var ErrUnsupported = errors.New("guestinit: not supported on this OS")

// ErrNoPlan is Setup's error on a kernel command line without a readable
// box plan (PlanParam): a guest never makes up a box of its own. The host
// that boots this image predates the plan, or wrote one this agent cannot
// read.
var ErrNoPlan = errors.New("guestinit: no box plan on the kernel command line (" + PlanParam + "): boot this image with the kiln it was built with")

// PlanParam is the kernel command-line word (PlanParam=VALUE) that
// carries the box plan (boxpolicy.Plan) the host computed: its JSON,
// base64url-encoded. Stage 2 builds the box from it and from nothing
// else: its tmpfs mounts and their caps, its /proc masks, rlimits,
// environment and host name. Parameters with a dot are the kernel's
// module parameters, so it never reaches init's environment.
const PlanParam = "kiln.plan"

// MaxCmdline is the longest kernel command line x86's kernel takes
// (COMMAND_LINE_SIZE, less its NUL); a longer one is cut.
const MaxCmdline = 2047

// Params are the kiln.* kernel command line parameters the host sets:
// the box plan, and how the guest itself is wired (its disks, its stream
// to the host, the memory of its code cgroup).
type Params struct {
	Plan        *boxpolicy.Plan // kiln.plan; nil: none, or unreadable
	MemoryBytes int64           // kiln.mem: memory.max of CodeCgroup
	Port        string          // kiln.port: the virtio-serial port name
	Transport   string          // kiln.transport: "serial" (virtio-serial) or "vsock"
	VsockPort   uint32          // kiln.vsock_port: where the agent listens with vsock
	Root        string          // root= (stage 1)
	RootFSType  string          // rootfstype= (stage 1)
}

// Defaults used when the command line does not say. The box plan has
// none: without one, Setup fails.
var defaults = Params{
	MemoryBytes: 1 << 30,
	Port:        PortName,
	Transport:   "serial",
	VsockPort:   1024,
	Root:        "/dev/vda",
	RootFSType:  "ext4",
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
	{PlanParam, func(p *Params) string { return encodePlan(p.Plan) }, func(p *Params, v string) bool {
		plan, ok := decodePlan(v)
		if ok {
			p.Plan = plan
		}
		return ok
	}},
	{"kiln.mem", func(p *Params) string { return itoa(p.MemoryBytes) }, func(p *Params, v string) bool { return setSize(&p.MemoryBytes, v) }},
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

// encodePlan is plan as PlanParam's value: its JSON, deflated (the
// kernel takes MaxCmdline bytes in all, and a plan with a network is
// most of that in plain JSON), in base64url after planDeflated, which no
// kernel or init parser splits; "" for none.
func encodePlan(plan *boxpolicy.Plan) string {
	if plan == nil {
		return ""
	}
	b, err := json.Marshal(plan)
	if err != nil {
		return ""
	}
	var z bytes.Buffer
	w, _ := flate.NewWriter(&z, flate.BestCompression)
	w.Write(b)
	w.Close()
	return planDeflated + base64.RawURLEncoding.EncodeToString(z.Bytes())
}

// planDeflated starts a deflated plan; a value without it is plain JSON
// (the hosts before it).
const planDeflated = "z."

// maxPlan bounds an inflated plan.
const maxPlan = 64 << 10

// decodePlan reads PlanParam's value, and refuses a plan the guest
// could not build a box from: one without its workspace or host name,
// or naming an rlimit it does not know.
func decodePlan(v string) (*boxpolicy.Plan, bool) {
	z, deflated := strings.CutPrefix(v, planDeflated)
	b, err := base64.RawURLEncoding.DecodeString(z)
	if err != nil {
		return nil, false
	}
	if deflated {
		if b, err = io.ReadAll(io.LimitReader(flate.NewReader(bytes.NewReader(b)), maxPlan+1)); err != nil || len(b) > maxPlan {
			return nil, false
		}
	}
	var plan boxpolicy.Plan
	if err := json.Unmarshal(b, &plan); err != nil {
		return nil, false
	}
	if plan.Workspace == "" || !validHostname(plan.Hostname) {
		return nil, false
	}
	for _, r := range plan.Rlimits {
		if _, ok := boxpolicy.RlimitResource(r.Name); !ok {
			return nil, false
		}
	}
	for _, t := range plan.Tmpfs {
		if !strings.HasPrefix(t.Path, "/") || t.Size <= 0 {
			return nil, false
		}
	}
	return &plan, true
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
// Cmdline (the guest would use the default instead, or, for the plan,
// refuse to start).
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
// or malformed values keep their defaults (a plan: nil). Everything after
// "--" belongs to init and is ignored.
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
	msBind   uintptr = 0x1000
)

// mounts returns what stage 2 mounts, in order: the guest's own
// filesystems (what a VM's kernel needs and a jail gets from its host),
// then the box's size-capped tmpfs mounts as the plan has them, then the
// plan's /proc masks.
func mounts(plan *boxpolicy.Plan) []mount {
	m := []mount{
		// hidepid=2: code running as the unprivileged user cannot see
		// the agent's processes.
		{"proc", "/proc", "proc", msNosuid | msNodev | msNoexec, "hidepid=2"},
		{"sysfs", "/sys", "sysfs", msNosuid | msNodev | msNoexec | msRdonly, ""},
		{"devtmpfs", "/dev", "devtmpfs", msNosuid | msNoexec, "mode=0755"},
		{"devpts", "/dev/pts", "devpts", msNosuid | msNoexec, "newinstance,ptmxmode=0666,mode=0620"},
		{"tmpfs", "/run", "tmpfs", msNosuid | msNodev | msNoexec, "mode=0755,size=1048576"},
	}
	for _, t := range plan.Tmpfs {
		m = append(m, mount{"tmpfs", t.Path, "tmpfs", msNosuid | msNodev, t.Options()})
	}
	// As the jail masks: /dev/null over each (reading one finds
	// nothing), or the file itself read-only (every write fails). A mask
	// whose file this kernel lacks is skipped.
	for _, name := range plan.ProcMasks {
		p := "/proc/" + name
		if slices.Contains(plan.ProcReadOnly, name) {
			m = append(m, mount{p, p, "", msBind | msRdonly | msNosuid | msNodev | msNoexec, ""})
			continue
		}
		m = append(m, mount{"/dev/null", p, "", msBind | msNosuid | msNoexec, ""})
	}
	return m
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

// codeCgroupFiles are written into CodeCgroup, in order: the box's memory
// (p.MemoryBytes, without swap) and its processes, which the plan bounds
// as RLIMIT_NPROC.
func codeCgroupFiles(p Params) []struct{ file, value string } {
	pids := "max"
	for _, r := range p.Plan.Rlimits {
		if r.Name == "RLIMIT_NPROC" {
			pids = fmt.Sprint(r.Value)
		}
	}
	return []struct{ file, value string }{
		{"memory.max", fmt.Sprint(p.MemoryBytes)},
		{"memory.swap.max", "0"},
		{"pids.max", pids},
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
