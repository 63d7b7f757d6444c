// Package boxpolicy is what a box is, written once for every backend: the
// declarative plan of what a box is made of (its paths, the filesystems
// mounted in it and their sizes, the /proc files masked in it, its Landlock
// rules, rlimits, environment and /etc) and the syscall policy its code runs
// under (syscalls.go). Each backend interprets it in its own way (the jail's
// Go init, the jail zygote's python, gVisor's OCI spec, the microVM guest)
// and none spells any of it again.
//
// The package is data only, built from the standard library, so that the
// code inside a box (kiln-agent, the microVM guest's init) can use it too.
package boxpolicy

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
)

// Paths inside every box.
const (
	// Workspace is the code's writable, size-capped working directory.
	Workspace = "/work"
	// Tmp is the box's size-capped /tmp.
	Tmp = "/tmp"
	// DevShm is POSIX shared memory, size-capped.
	DevShm = "/dev/shm"
	// Home is the code's box-private HOME, outside the workspace (the
	// agent creates it), so that what tools keep under ~ and in their
	// caches (fontconfig, pip, matplotlib, shells' histories) never comes
	// back as files the code made.
	Home = Tmp + "/home"
	// Cache is XDG_CACHE_HOME, under Home: fontconfig and friends stay out
	// of the workspace.
	Cache = Home + "/.cache"
	// AgentPath is where kiln-agent is bound read-only in a box built on
	// the host's runtime or on an image root (the jail, gVisor, whose
	// Options.Rootfs must hold it as a mount point).
	AgentPath = "/.kiln/kiln-agent"
	// Hostname is every box's host name.
	Hostname = "kiln"
	// TrustBundle is where a box whose egress has secrets finds the CA
	// bundle it trusts: the host's roots and the egress gateway's own CA
	// (egress.Attachment.TrustBundle).
	TrustBundle = "/etc/kiln-egress-ca.pem"
	// TemplateDir is where a configured template's files are bound,
	// read-only, in every box of a server started with one (kiln template).
	TemplateDir = "/template"
	// TemplatePython is the directory under TemplateDir that is on
	// PYTHONPATH: a template's setup installs modules there
	// (pip install --target).
	TemplatePython = TemplateDir + "/python"
)

// The unprivileged user code runs as inside a box; the agent runs as root
// of the box, apart from it.
const (
	UID    = 1000
	GID    = 1000
	User   = "sandbox"
	Nobody = 65534
)

// RuntimeDirs are the host directories a box built from the host's runtime
// sees read-only: the interpreter and its libraries, nothing else. A host
// symlink (merged /usr) is recreated as the same symlink.
var RuntimeDirs = []string{"/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"}

// EtcFromHost are harmless host entries under /etc (names relative to it)
// that the runtime needs, bound or copied read-only into a host-runtime
// box: the dynamic loader's cache, the alternatives that numpy's BLAS goes
// through, fonts and matplotlib's defaults, time zone, CA certificates for
// HTTPS under an egress allowlist. Never passwd, shadow, hosts or anything
// with secrets: those are synthesized (Etc).
var EtcFromHost = []string{
	"ld.so.cache", "ld.so.conf", "ld.so.conf.d",
	"alternatives",
	"fonts", "matplotlibrc",
	"localtime", "timezone", "mime.types",
	"ssl/certs", "ssl/openssl.cnf", "ca-certificates.conf",
	"python3", "python3.11", "python3.12", "python3.13",
	"bash.bashrc", "inputrc",
}

// DevNodes are bound from the host's /dev into a jailed box's small /dev.
var DevNodes = []string{"null", "zero", "full", "random", "urandom"}

// ProcMasks are the files under /proc every box gets /dev/null over.
var ProcMasks = []string{"sysrq-trigger", "kcore", "timer_list", "keys"}

// ProcReadOnly are the ProcMasks bound read-only onto themselves rather
// than masked with /dev/null, so that a write fails (EROFS) instead of
// vanishing into /dev/null: the hostile battery's contract is that every
// write to them fails. (The OCI runtime spec's readonlyPaths do the same
// for /proc/sysrq-trigger.) Found by the field-host VM: the development
// machine's /proc has no sysrq-trigger.
var ProcReadOnly = []string{"sysrq-trigger"}

// DevShmBytes and DevShmInodes cap every box's /dev/shm.
const (
	DevShmBytes  = 64 << 20
	DevShmInodes = 1024
)

// Env is the environment of a box's agent and, through it, of code.
// Backends that start the agent give it this and UserEnv (plus what their
// operator or the egress gateway adds); the agent fills in whatever of it
// is missing for code.
var Env = []string{
	"PATH=/usr/local/bin:/usr/bin:/bin",
	"HOME=" + Home,
	"XDG_CACHE_HOME=" + Cache,
	"LANG=C.UTF-8",
	"TMPDIR=" + Tmp,
	"MPLBACKEND=Agg",
	"MPLCONFIGDIR=" + Tmp + "/.matplotlib",
	"TERM=dumb",
	"PYTHONDONTWRITEBYTECODE=1",
}

// UserEnv names the code's user, uid, as Etc does.
func UserEnv(uid int) []string {
	name := User
	if uid == Nobody {
		name = "nobody"
	}
	return []string{"USER=" + name, "LOGNAME=" + name}
}

// Etc is the synthesized part of every box's /etc: file name to content.
// uid and gid are the code's user, which is named User unless it is
// nobody.
func Etc(hostname, resolvConf string, uid, gid int) map[string]string {
	passwd := "root:x:0:0:root:/root:/usr/sbin/nologin\n"
	group := "root:x:0:\n"
	if uid != Nobody {
		passwd += fmt.Sprintf("%s:x:%d:%d:%s:%s:/bin/bash\n", User, uid, gid, User, Home)
	}
	if gid != Nobody {
		group += fmt.Sprintf("%s:x:%d:\n", User, gid)
	}
	return map[string]string{
		"passwd":        passwd + "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
		"group":         group + "nogroup:x:65534:\n",
		"hosts":         "127.0.0.1\tlocalhost " + hostname + "\n::1\tlocalhost ip6-localhost ip6-loopback\n",
		"hostname":      hostname + "\n",
		"resolv.conf":   resolvConf,
		"nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
	}
}

// Limits are the sizes a plan is made from (the host's sandbox.Limits).
type Limits struct {
	WorkspaceBytes int64
	TmpBytes       int64
	Inodes         int
	Pids           int
	OpenFiles      int
}

// Plan is what one box is made of, beyond its read-only runtime.
type Plan struct {
	Hostname  string   `json:"hostname"`
	Workspace string   `json:"workspace"`
	Tmpfs     []Tmpfs  `json:"tmpfs"`      // in mount order
	ProcMasks []string `json:"proc_masks"` // names under /proc, masked with /dev/null
	// ProcReadOnly are the ProcMasks bound read-only onto themselves
	// instead (see the variable).
	ProcReadOnly []string   `json:"proc_read_only"`
	Rlimits      []Rlimit   `json:"rlimits"`
	Landlock     []PathRule `json:"landlock"`
	Env          []string   `json:"env"`
	// Network is the box's link to the egress gateway, for a box that
	// configures its own interface (the microVM guest); nil: loopback
	// only. Its proxy environment is in Env like the rest.
	Network *Network `json:"network,omitempty"`
}

// Network is what a guest needs to reach the egress gateway, the same for
// every box of one gateway and policy, so that a template VM can boot
// with it: the box's own address differs per box and comes after
// restore, with the seed (guestinit.SeedPortName).
type Network struct {
	// Gateway is the gateway's DNS responder and HTTP proxy, the box's
	// default route; Transparent its transparent listeners. Both are
	// on-link routes of the box's /32 (see package egress).
	Gateway     string `json:"gateway"`
	Transparent string `json:"transparent"`
	// ResolvConf is the box's /etc/resolv.conf.
	ResolvConf string `json:"resolv_conf"`
	// TrustBundle says that the host sends a CA bundle with the address,
	// which the guest puts at TrustBundle (the gateway has secrets).
	TrustBundle bool `json:"trust_bundle,omitempty"`
}

// Digest names p: the start of the SHA-256 of its JSON. A box that
// builds itself from a plan it was sent (the microVM guest) announces
// the digest of what it applied, and the host compares.
func (p Plan) Digest() string {
	b, _ := json.Marshal(p) // a Plan holds nothing json cannot encode
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:8])
}

// Tmpfs is one size-capped tmpfs of a box, mounted nosuid and nodev.
type Tmpfs struct {
	Path   string `json:"path"`
	Mode   string `json:"mode"` // octal
	Size   int64  `json:"size"`
	Inodes int    `json:"inodes,omitempty"` // 0: the kernel's default
	UID    int    `json:"uid"`              // owner of its root; -1: the mounter
	GID    int    `json:"gid"`
}

// Options is the tmpfs mount data.
func (t Tmpfs) Options() string {
	s := "mode=" + t.Mode + ",size=" + strconv.FormatInt(t.Size, 10)
	if t.Inodes > 0 {
		s += ",nr_inodes=" + strconv.Itoa(t.Inodes)
	}
	if t.UID >= 0 {
		s += ",uid=" + strconv.Itoa(t.UID) + ",gid=" + strconv.Itoa(t.GID)
	}
	return s
}

// Rlimit is one resource limit, soft and hard, named as in OCI
// ("RLIMIT_NOFILE").
type Rlimit struct {
	Name  string `json:"name"`
	Value uint64 `json:"value"`
}

// Access is what a Landlock rule grants beneath its path.
type Access int

const (
	// ListDir only lists a directory.
	ListDir Access = iota
	// ReadDir reads and executes what is beneath a directory.
	ReadDir
	// ReadWriteDir reads, writes, creates and removes beneath a directory.
	ReadWriteDir
	// ReadWriteFile reads and writes one file.
	ReadWriteFile
)

// PathRule is one Landlock rule. Everything not beneath one is refused.
type PathRule struct {
	Path   string `json:"path"`
	Access Access `json:"access"`
}

// New is the plan of a box with limits l whose workspace belongs to uid
// and gid (-1: to whoever mounts it).
func New(l Limits, uid, gid int) Plan {
	return Plan{
		Hostname:  Hostname,
		Workspace: Workspace,
		Tmpfs: []Tmpfs{
			{Path: Workspace, Mode: "755", Size: l.WorkspaceBytes, Inodes: l.Inodes, UID: uid, GID: gid},
			{Path: Tmp, Mode: "1777", Size: l.TmpBytes, Inodes: l.Inodes, UID: -1, GID: -1},
			{Path: DevShm, Mode: "1777", Size: DevShmBytes, Inodes: DevShmInodes, UID: -1, GID: -1},
		},
		ProcMasks:    ProcMasks,
		ProcReadOnly: ProcReadOnly,
		Rlimits: []Rlimit{
			{"RLIMIT_CORE", 0},
			{"RLIMIT_NOFILE", uint64(l.OpenFiles)},
			{"RLIMIT_NPROC", uint64(l.Pids)},
		},
		Landlock: landlock(),
		Env:      Env,
	}
}

// landlock is the box's filesystem rules: the read-only runtime and the
// box's own /etc, /proc, /dev and agent; listing / shows only the box's
// own mounts (reading what is under it is governed by the other rules);
// the workspace, /tmp and /dev/shm are writable, and so are the harmless
// device nodes.
func landlock() []PathRule {
	var rules []PathRule
	add := func(a Access, paths ...string) {
		for _, p := range paths {
			rules = append(rules, PathRule{Path: p, Access: a})
		}
	}
	add(ReadDir, "/etc", "/proc", "/dev", "/.kiln")
	for _, d := range RuntimeDirs {
		if st, err := os.Lstat(d); err == nil && st.IsDir() {
			add(ReadDir, d)
		}
	}
	add(ListDir, "/")
	add(ReadWriteDir, Workspace, Tmp, DevShm)
	add(ReadWriteFile, "/dev/null", "/dev/zero", "/dev/full")
	return rules
}
