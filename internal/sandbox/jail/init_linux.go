package jail

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"syscall"
	"unsafe"

	"github.com/landlock-lsm/go-landlock/landlock"
	llsys "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox/boxkit"
)

// InitArg is the hidden first argument with which kiln re-executes itself
// as a box's init (the runc pattern): it runs in the new namespaces, builds
// the box's root, drops every privilege and execs kiln-agent.
const InitArg = "__kiln_jail_init"

// initConfig travels from the host to the init over fd 3.
type initConfig struct {
	Root       string         `json:"root"`  // empty host directory to build the root on
	Agent      string         `json:"agent"` // host path of kiln-agent
	AgentArgs  []string       `json:"agent_args"`
	Plan       boxpolicy.Plan `json:"plan"` // the box's mounts, limits, rules and environment
	ResolvConf string         `json:"resolv_conf"`
	// TrustBundle, when set, is written to boxpolicy.TrustBundle: the
	// egress gateway's CA for hosts with secrets, beside the host's roots.
	TrustBundle string `json:"trust_bundle,omitempty"`
	Rootless    bool   `json:"rootless"`              // only uid 0 is mapped: stay 0, without capabilities
	Template    string `json:"template,omitempty"`    // host dir bound at boxpolicy.TemplateDir (template_linux.go)
	TemplateRW  bool   `json:"template_rw,omitempty"` // writable: the template's setup
}

// MaybeInit runs the box init and never returns when the process was
// started as one; otherwise it returns at once. cmd/kiln (and test
// binaries that create jails) call it first thing in main.
func MaybeInit() {
	if len(os.Args) < 2 || (os.Args[1] != InitArg && os.Args[1] != ZygoteInitArg) {
		return
	}
	runtime.LockOSThread()
	// The box's tree gets the modes written here whatever umask the
	// server runs under: under the systemd unit's UMask=0077 its /etc,
	// /dev and the agent's directory came out 0700, out of the box user's
	// reach (numpy lost its BLAS, the zygote could not exec the agent).
	// Code in the box starts with the usual 022 too.
	syscall.Umask(0o022)
	run := runInit
	if os.Args[1] == InitArg && len(os.Args) > 2 && os.Args[2] == awaitIDsArg {
		run = awaitIDs
	}
	if os.Args[1] == ZygoteInitArg {
		run = runZygoteInit
	}
	err := run()
	fmt.Fprintf(os.Stderr, "kiln jail init: %v\n", err)
	os.Exit(1)
}

func runInit() error {
	cfg, err := prepare([]initStep{
		{"building root", buildRoot},
		{"entering root", enterRoot},
		{"setting up network", setupNetwork},
		{"setting limits", setRlimits},
		{"dropping privileges", dropPrivileges},
		{"restricting filesystem", restrictFS},
		{"loading seccomp filter", loadSeccomp},
	})
	if err != nil {
		return err
	}
	return execAgent(cfg)
}

// initStep is one named step of setting up a box (or a template).
type initStep struct {
	name string
	fn   func(*initConfig) error
}

// prepare closes the executable we were started through (fd 4), reads the
// config from fd 3 and runs the steps in order.
func prepare(steps []initStep) (*initConfig, error) {
	unix.Close(4)
	f := os.NewFile(3, "config")
	var cfg initConfig
	if err := json.NewDecoder(f).Decode(&cfg); err != nil {
		return nil, fmt.Errorf("reading config: %w", err)
	}
	f.Close()
	for _, s := range steps {
		if err := s.fn(&cfg); err != nil {
			return nil, fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return &cfg, nil
}

func execAgent(cfg *initConfig) error {
	argv := append([]string{"kiln-agent"}, cfg.AgentArgs...)
	return fmt.Errorf("executing agent: %w", unix.Exec(boxpolicy.AgentPath, argv, cfg.Plan.Env))
}

func mount(src, dst, fstype string, flags uintptr, data string) error {
	if err := unix.Mount(src, dst, fstype, flags, data); err != nil {
		return fmt.Errorf("mounting %s on %s: %w", src, dst, err)
	}
	return nil
}

// bindRO binds src on dst read-only, keeping the flags the kernel locks in
// a user namespace (nodev, noexec, atime) from the source mount.
func bindRO(src, dst string) error {
	if err := mount(src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dst, &st); err != nil {
		return err
	}
	locked := uintptr(st.Flags) & (unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_NOATIME | unix.MS_NODIRATIME | unix.MS_RELATIME)
	return mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|locked, "")
}

func touch(p string) error {
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	return f.Close()
}

// bindHost binds host path src (a file or a directory) read-only at the
// same path under root, if it exists.
func bindHost(root, src string) error {
	st, err := os.Stat(src)
	if err != nil {
		return nil // absent on this host
	}
	dst := filepath.Join(root, src)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if st.IsDir() {
		err = os.MkdirAll(dst, 0o755)
	} else {
		err = touch(dst)
	}
	if err != nil {
		return err
	}
	return bindRO(src, dst)
}

func buildRoot(cfg *initConfig) error {
	root := cfg.Root
	if err := mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return err
	}
	if err := mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=755,size=4m"); err != nil {
		return err
	}
	for _, d := range boxpolicy.RuntimeDirs {
		st, err := os.Lstat(d)
		switch {
		case err != nil:
			continue
		case st.Mode()&os.ModeSymlink != 0:
			target, err := os.Readlink(d)
			if err != nil {
				return err
			}
			if err := os.Symlink(target, filepath.Join(root, d)); err != nil {
				return err
			}
		case st.IsDir():
			if err := bindHost(root, d); err != nil {
				return err
			}
		}
	}
	// /etc: synthesized files and a few harmless host ones.
	etc := filepath.Join(root, "etc")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		return err
	}
	for name, content := range boxpolicy.Etc(cfg.Plan.Hostname, cfg.ResolvConf, boxUID, boxGID) {
		if err := os.WriteFile(filepath.Join(etc, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	if cfg.TrustBundle != "" {
		if err := os.WriteFile(filepath.Join(root, boxpolicy.TrustBundle), []byte(cfg.TrustBundle), 0o644); err != nil {
			return err
		}
	}
	for _, name := range boxpolicy.EtcFromHost {
		p := filepath.Join("/etc", name)
		if err := bindHost(root, p); err != nil {
			return fmt.Errorf("binding %s: %w", p, err)
		}
	}
	// /proc of the box's own pid namespace; /proc/sys read-only.
	procDir := filepath.Join(root, "proc")
	if err := os.MkdirAll(procDir, 0o555); err != nil {
		return err
	}
	if err := mount("proc", procDir, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := bindRO(filepath.Join(procDir, "sys"), filepath.Join(procDir, "sys")); err != nil {
		return err
	}
	for _, p := range cfg.Plan.ProcMasks {
		dst := filepath.Join(procDir, p)
		if _, err := os.Stat(dst); err != nil {
			continue
		}
		if slices.Contains(cfg.Plan.ProcReadOnly, p) {
			if err := bindRO(dst, dst); err != nil {
				return fmt.Errorf("masking %s: %w", p, err)
			}
			continue
		}
		mount("/dev/null", dst, "", unix.MS_BIND, "")
	}
	// /dev: a few nodes bound from the host, and a size-capped /dev/shm.
	dev := filepath.Join(root, "dev")
	if err := os.MkdirAll(dev, 0o755); err != nil {
		return err
	}
	if err := mount("tmpfs", dev, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=755,size=65536,nr_inodes=64"); err != nil {
		return err
	}
	for _, n := range boxpolicy.DevNodes {
		dst := filepath.Join(dev, n)
		if err := touch(dst); err != nil {
			return err
		}
		if err := mount("/dev/"+n, dst, "", unix.MS_BIND, ""); err != nil {
			return err
		}
	}
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		if err := os.Symlink(target, filepath.Join(dev, name)); err != nil {
			return err
		}
	}
	// The workspace, /tmp and /dev/shm.
	for _, t := range cfg.Plan.Tmpfs {
		dst := filepath.Join(root, t.Path)
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
		if err := mount("tmpfs", dst, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, t.Options()); err != nil {
			return err
		}
	}
	// The agent binary, read-only.
	agentDst := filepath.Join(root, boxpolicy.AgentPath)
	if err := os.MkdirAll(filepath.Dir(agentDst), 0o755); err != nil {
		return err
	}
	if err := touch(agentDst); err != nil {
		return err
	}
	if err := bindRO(cfg.Agent, agentDst); err != nil {
		return err
	}
	return bindTemplate(cfg)
}

func enterRoot(cfg *initConfig) error {
	if err := unix.Chdir(cfg.Root); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detaching old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	// The root itself (with /etc) becomes read-only; /work, /tmp and
	// /dev/shm are their own mounts and stay writable.
	if err := mount("", "/", "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return err
	}
	if err := unix.Sethostname([]byte(cfg.Plan.Hostname)); err != nil {
		return err
	}
	// Own cgroup namespace: the host put us in the box's cgroup already,
	// so /proc/self/cgroup shows "/" and nothing of the host's layout.
	return unix.Unshare(unix.CLONE_NEWCGROUP)
}

// setupNetwork brings up the loopback of the box's own network namespace.
func setupNetwork(cfg *initConfig) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

func setRlimits(cfg *initConfig) error {
	for _, l := range cfg.Plan.Rlimits {
		res, ok := boxpolicy.RlimitResource(l.Name)
		if !ok {
			return fmt.Errorf("unknown rlimit %s", l.Name)
		}
		if err := unix.Setrlimit(res, &unix.Rlimit{Cur: l.Value, Max: l.Value}); err != nil {
			return fmt.Errorf("%s: %w", l.Name, err)
		}
	}
	return nil
}

// dropPrivileges leaves the init, and the agent it execs, root of the box's
// user namespace with only agentCaps (permitted, effective and inheritable
// sets, which a root exec keeps; an empty bounding set, nothing ambient)
// and no_new_privs: the agent runs as
// a different uid from the code it starts as boxUID with no capability at
// all, so code can neither signal, trace nor read it. Rootless, only uid 0
// is mapped: agent and code share it, and nothing keeps a capability.
func dropPrivileges(cfg *initConfig) error {
	keep := boxkit.CapMask(agentCaps)
	if cfg.Rootless {
		keep = 0
	}
	if err := boxkit.LimitCaps(keep); err != nil {
		return err
	}
	return unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
}

// becomeTemplateUser makes a zygote template's init the unprivileged host
// uid uidBase holding only templateCaps, in the host's user namespace, as
// ambient capabilities so that they survive the execs into kiln-agent and
// python. Raw syscalls on this locked thread: it is the one that execs.
func becomeTemplateUser(cfg *initConfig) error {
	keep := boxkit.CapMask(templateCaps)
	if err := boxkit.DropBounding(keep); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_KEEPCAPS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("keeping capabilities: %w", err)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 0, 0, 0); e != 0 {
		return fmt.Errorf("setgroups: %w", e)
	}
	id := uintptr(uidBase)
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, id, id, id); e != 0 {
		return fmt.Errorf("setresgid: %w", e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, id, id, id); e != 0 {
		return fmt.Errorf("setresuid: %w", e)
	}
	if err := boxkit.SetCaps(keep, keep); err != nil {
		return err
	}
	for _, c := range templateCaps {
		if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_RAISE, c, 0, 0); err != nil {
			return fmt.Errorf("raising ambient capability %d: %w", c, err)
		}
	}
	return unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
}

// restrictFS enters the plan's Landlock rules, best effort: on a kernel
// without Landlock, or with an older ABI, what it cannot enforce is left
// out (the other layers still hold).
func restrictFS(cfg *initConfig) error {
	rules := make([]landlock.Rule, 0, len(cfg.Plan.Landlock))
	for _, r := range cfg.Plan.Landlock {
		switch r.Access {
		case boxpolicy.ListDir:
			rules = append(rules, landlock.PathAccess(llsys.AccessFSReadDir, r.Path))
		case boxpolicy.ReadDir:
			rules = append(rules, landlock.RODirs(r.Path))
		case boxpolicy.ReadWriteDir:
			rules = append(rules, landlock.RWDirs(r.Path))
		case boxpolicy.ReadWriteFile:
			rules = append(rules, landlock.RWFiles(r.Path))
		default:
			return fmt.Errorf("unknown landlock access %d for %s", r.Access, r.Path)
		}
	}
	return landlock.V5.BestEffort().RestrictPaths(rules...)
}

// loadSeccomp sets no_new_privs and loads the box's seccomp program
// (seccomp.go) on every thread of the init; kiln-agent is exec'd under it.
func loadSeccomp(cfg *initConfig) error {
	raw, err := seccompRaw()
	if err != nil {
		return err
	}
	filter := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		filter[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("setting no_new_privs: %w", err)
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&prog)))
	runtime.KeepAlive(filter)
	if errno != 0 {
		return fmt.Errorf("loading filter: %w", errno)
	}
	if r != 0 {
		return fmt.Errorf("loading filter: thread %d could not be synchronized", r)
	}
	return nil
}

var _ = unsafe.Pointer(nil)
var _ = syscall.Getpid
