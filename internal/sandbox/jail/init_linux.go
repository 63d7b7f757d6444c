package jail

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"unsafe"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/landlock-lsm/go-landlock/landlock"
	llsys "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"

	"kiln/internal/sandbox"
)

// InitArg is the hidden first argument with which kiln re-executes itself
// as a box's init (the runc pattern): it runs in the new namespaces, builds
// the box's root, drops every privilege and execs kiln-agent.
const InitArg = "__kiln_jail_init"

// initConfig travels from the host to the init over fd 3.
type initConfig struct {
	Root       string   `json:"root"`  // empty host directory to build the root on
	Agent      string   `json:"agent"` // host path of kiln-agent
	AgentArgs  []string `json:"agent_args"`
	Env        []string `json:"env"`
	Hostname   string   `json:"hostname"`
	ResolvConf string   `json:"resolv_conf"`
	Rootless   bool     `json:"rootless"` // only uid 0 is mapped: stay 0, without capabilities
	Workspace  int64    `json:"workspace"`
	Tmp        int64    `json:"tmp"`
	Inodes     int      `json:"inodes"`
	Pids       int      `json:"pids"`
	OpenFiles  int      `json:"open_files"`
}

// MaybeInit runs the box init and never returns when the process was
// started as one; otherwise it returns at once. cmd/kiln (and test
// binaries that create jails) call it first thing in main.
func MaybeInit() {
	if len(os.Args) < 2 || (os.Args[1] != InitArg && os.Args[1] != ZygoteInitArg) {
		return
	}
	runtime.LockOSThread()
	run := runInit
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
	return fmt.Errorf("executing agent: %w", unix.Exec("/.kiln/agent", argv, cfg.Env))
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

func tmpfs(dst string, size int64, inodes int, mode string, owner int) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	opts := "mode=" + mode + ",size=" + strconv.FormatInt(size, 10)
	if inodes > 0 {
		opts += ",nr_inodes=" + strconv.Itoa(inodes)
	}
	if owner >= 0 {
		opts += ",uid=" + strconv.Itoa(owner) + ",gid=" + strconv.Itoa(owner)
	}
	return mount("tmpfs", dst, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts)
}

func buildRoot(cfg *initConfig) error {
	root := cfg.Root
	if err := mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return err
	}
	if err := mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=755,size=4m"); err != nil {
		return err
	}
	for _, d := range runtimeDirs {
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
	for name, content := range etcFiles(cfg.Hostname, cfg.ResolvConf) {
		if err := os.WriteFile(filepath.Join(etc, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	for _, p := range etcFromHost {
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
	for _, p := range []string{"sysrq-trigger", "kcore", "timer_list", "keys"} {
		if _, err := os.Stat(filepath.Join(procDir, p)); err == nil {
			mount("/dev/null", filepath.Join(procDir, p), "", unix.MS_BIND, "")
		}
	}
	// /dev: a few nodes bound from the host, and a size-capped /dev/shm.
	dev := filepath.Join(root, "dev")
	if err := tmpfs(dev, 64<<10, 64, "755", -1); err != nil {
		return err
	}
	for _, n := range devNodes {
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
	if err := tmpfs(filepath.Join(dev, "shm"), 64<<20, 1024, "1777", -1); err != nil {
		return err
	}
	owner := boxUID
	if cfg.Rootless {
		owner = 0
	}
	if err := tmpfs(filepath.Join(root, "work"), cfg.Workspace, cfg.Inodes, "755", owner); err != nil {
		return err
	}
	if err := tmpfs(filepath.Join(root, "tmp"), cfg.Tmp, cfg.Inodes, "1777", -1); err != nil {
		return err
	}
	// The agent binary, read-only.
	agentDst := filepath.Join(root, ".kiln", "agent")
	if err := os.MkdirAll(filepath.Dir(agentDst), 0o755); err != nil {
		return err
	}
	if err := touch(agentDst); err != nil {
		return err
	}
	return bindRO(cfg.Agent, agentDst)
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
	if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
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
	limits := []struct {
		res int
		val uint64
	}{
		{unix.RLIMIT_CORE, 0},
		{unix.RLIMIT_NOFILE, uint64(cfg.OpenFiles)},
		{unix.RLIMIT_NPROC, uint64(cfg.Pids)},
	}
	for _, l := range limits {
		if err := unix.Setrlimit(l.res, &unix.Rlimit{Cur: l.val, Max: l.val}); err != nil {
			return fmt.Errorf("rlimit %d: %w", l.res, err)
		}
	}
	return nil
}

// dropPrivileges empties the capability bounding set and becomes the
// unprivileged box user, so nothing exec'd afterwards can hold a capability.
func dropPrivileges(cfg *initConfig) error {
	for c := 0; c <= 63; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("dropping capability %d: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return err
	}
	if !cfg.Rootless {
		// Raw syscalls on this locked thread: it is the one that execs.
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, boxGID, boxGID, boxGID); e != 0 {
			return fmt.Errorf("setresgid: %w", e)
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, boxUID, boxUID, boxUID); e != 0 {
			return fmt.Errorf("setresuid: %w", e)
		}
	}
	// Clear whatever capabilities remain on this thread.
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
}

func restrictFS(cfg *initConfig) error {
	ro := []string{"/etc", "/proc", "/dev", "/.kiln"}
	for _, d := range runtimeDirs {
		if st, err := os.Lstat(d); err == nil && st.IsDir() {
			ro = append(ro, d)
		}
	}
	return landlock.V5.BestEffort().RestrictPaths(
		landlock.RODirs(ro...),
		// Listing / shows only the box's own mounts; reading what is
		// under it is governed by the rules above.
		landlock.PathAccess(llsys.AccessFSReadDir, "/"),
		landlock.RWDirs("/work", "/tmp", "/dev/shm"),
		landlock.RWFiles("/dev/null", "/dev/zero", "/dev/full"),
	)
}

func seccompFilter() seccomp.Filter {
	var cond []seccomp.NameWithConditions
	for _, flag := range sandbox.DeniedCloneFlags {
		cond = append(cond, seccomp.NameWithConditions{Name: "clone", Conditions: []seccomp.Condition{{Argument: 0, Operation: seccomp.BitsSet, Value: flag}}})
	}
	cond = append(cond,
		seccomp.NameWithConditions{Name: "socket", Conditions: []seccomp.Condition{{Argument: 0, Operation: seccomp.Equal, Value: sandbox.AFPacket}}},
	)
	return seccomp.Filter{
		NoNewPrivs: true,
		Flag:       seccomp.FilterFlagTSync,
		Policy: seccomp.Policy{
			DefaultAction: seccomp.ActionAllow,
			Syscalls: []seccomp.SyscallGroup{
				{Action: seccomp.ActionErrno, Names: sandbox.DeniedSyscalls},
				{Action: seccomp.ActionErrno, NamesWithCondtions: cond},
				// clone3 passes its flags in memory, out of the filter's
				// reach: say it does not exist, and libc falls back to clone.
				{Action: seccomp.ActionErrno | seccomp.Action(unix.ENOSYS), Names: sandbox.AbsentSyscalls},
			},
		},
	}
}

func loadSeccomp(cfg *initConfig) error {
	return seccomp.LoadFilter(seccompFilter())
}

var _ = unsafe.Pointer(nil)
var _ = syscall.Getpid
