package boxkit

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
)

// A runtime kiln runs on the host for a box (QEMU for a microVM, Deno for
// a wasm box) is confined the way Firecracker's jailer does it: kiln
// re-executes itself with ConfineInitArg (the re-exec init pattern) in new
// user, mount, pid, net, ipc and uts namespaces, as a host uid no real user
// has; the init builds a root that holds only what the program needs,
// pivots into it, drops every capability (empty bounding set, locked
// securebits, no_new_privs), loads the program's seccomp filter if it has
// one, and execs it. Its network namespace is new and empty: it has no
// network at all.
//
// The init's uid cannot resolve kiln's root-owned paths (the image cache,
// the run directory), so kiln makes a detached bind mount of each file the
// program needs and the init attaches the inherited mount at a path in the
// new root.
//
// As a non-root user kiln cannot map a uid of its choosing: the user
// namespace maps only the user's own uid (as uid 0 of the namespace, which
// the securebits make an ordinary uid), and the init binds the files by
// path, which that uid can resolve. Everything else is the same.

// ConfineInitArg is the hidden first argument of the confinement init.
const ConfineInitArg = "__kiln_confine_init"

// ConfinedHostDirs are the host paths a confined program's root gets
// read-only: its libraries, modules and firmware. A path that is a symlink
// on the host (merged /usr) becomes the same symlink.
var ConfinedHostDirs = append(append([]string{}, boxpolicy.RuntimeDirs...), "/etc/ld.so.cache")

// ConfinedSees reports whether a confined program's root shows the host
// path p (symlinks resolved) without a Bind of its own: it lies beneath
// one of the ConfinedHostDirs that is a directory on this host.
func ConfinedSees(p string) bool {
	for _, d := range ConfinedHostDirs {
		if fi, err := os.Lstat(d); err == nil && fi.IsDir() && strings.HasPrefix(p, d+"/") {
			return true
		}
	}
	return false
}

// confinedDevices are the host device nodes bound into the root, read-only
// mounts (which do not stop a device from being opened for writing).
var confinedDevices = []string{"/dev/null", "/dev/zero", "/dev/urandom"}

// Confined is a program to run confined.
type Confined struct {
	// UID is the host uid (and gid) the program runs as: one no real
	// user has. Ignored when kiln is not root (the user's own).
	UID  int
	Exe  string // the program, a path in the new root
	Args []string
	Env  []string
	Dir  string // its working directory in the new root; "" for /
	// Files are its descriptors from 3 on (nil for a hole).
	Files []*os.File
	Binds []Bind
	// Proc mounts a proc of the program's own pid namespace at /proc.
	Proc bool
	// Seccomp is the program's syscall filter; nil for none (QEMU
	// applies its own).
	Seccomp []boxpolicy.SyscallRule
	// SeccompNotify makes the calls Seccomp's rules do not name, which
	// it refuses with ENOSYS, wait for a seccomp user notification
	// instead; the init then waits, before it execs the program, until
	// a byte arrives on (or EOF) the descriptor of this file, so that
	// the caller can take the listener (pidfd_getfd) from it. Only a
	// test that derives the filter from a run sets it.
	SeccompNotify *os.File
}

// Bind is a host path bound at a path in the new root.
type Bind struct {
	Src string // host path
	Dst string // in the new root
	Dir bool
	RW  bool
	Dev bool // a device node: keep dev
}

// confineConfig travels from kiln to the init as its second argument.
type confineConfig struct {
	Exe       string               `json:"exe"`
	Args      []string             `json:"args"`
	Env       []string             `json:"env"`
	Dir       string               `json:"dir,omitempty"`
	Mounts    []confineMount       `json:"mounts"`
	Proc      bool                 `json:"proc,omitempty"`
	CloseFrom int                  `json:"close_from"` // the first of the init's own descriptors
	Seccomp   []bpf.RawInstruction `json:"seccomp,omitempty"`
	NotifyFD  int                  `json:"notify_fd,omitempty"`
}

// confineMount is one entry of the new root: a bind of a host path or of
// an inherited descriptor, or a symlink.
type confineMount struct {
	Dst     string `json:"dst"`
	Src     string `json:"src,omitempty"` // host path
	FD      int    `json:"fd,omitempty"`  // or an inherited descriptor
	Symlink string `json:"symlink,omitempty"`
	// Detach makes the init bind Src detached before it builds the
	// root, which hides the host's confineRoot.
	Detach bool `json:"detach,omitempty"`
	Dir    bool `json:"dir,omitempty"`
	RW     bool `json:"rw,omitempty"`
	Dev    bool `json:"dev,omitempty"` // a device node: keep dev
}

// Command returns the command that runs c, and the descriptors it opened
// for it, which the caller closes once the command has started. self is
// kiln's own executable, open.
func (c Confined) Command(self *os.File) (_ *exec.Cmd, opened []*os.File, _ error) {
	root := os.Geteuid() == 0
	cfg := confineConfig{Exe: c.Exe, Args: c.Args, Env: c.Env, Dir: c.Dir, Proc: c.Proc}
	if cfg.Env == nil {
		cfg.Env = []string{"PATH=/usr/bin:/bin"}
	}
	for _, p := range ConfinedHostDirs {
		fi, err := os.Lstat(p)
		switch {
		case err != nil:
			continue
		case fi.Mode()&os.ModeSymlink != 0:
			l, err := os.Readlink(p)
			if err != nil {
				return nil, nil, fmt.Errorf("reading %s: %w", p, err)
			}
			cfg.Mounts = append(cfg.Mounts, confineMount{Dst: p, Symlink: l})
		default:
			cfg.Mounts = append(cfg.Mounts, confineMount{Dst: p, Src: p, Dir: fi.IsDir()})
		}
	}
	for _, d := range confinedDevices {
		cfg.Mounts = append(cfg.Mounts, confineMount{Dst: d, Src: d, Dev: true})
	}
	if c.Seccomp != nil {
		prog, err := SeccompProgram(c.Seccomp, c.SeccompNotify != nil)
		if err != nil {
			return nil, nil, err
		}
		cfg.Seccomp = prog
	}
	extra := append([]*os.File{}, c.Files...)
	cfg.CloseFrom = 3 + len(extra)
	selfFD := 3 + len(extra)
	extra = append(extra, self)
	if c.SeccompNotify != nil {
		cfg.NotifyFD = 3 + len(extra)
		extra = append(extra, c.SeccompNotify)
	}
	for _, b := range c.Binds {
		if !root {
			// The user's own uid resolves what the user can: the
			// init makes the detached bind itself.
			cfg.Mounts = append(cfg.Mounts, confineMount{Dst: b.Dst, Src: b.Src, Detach: true, Dir: b.Dir, RW: b.RW, Dev: b.Dev})
			continue
		}
		f, err := detachedBind(b)
		if err != nil {
			CloseFiles(opened)
			return nil, nil, err
		}
		opened = append(opened, f)
		cfg.Mounts = append(cfg.Mounts, confineMount{Dst: b.Dst, FD: 3 + len(extra), Dir: b.Dir, RW: b.RW, Dev: b.Dev})
		extra = append(extra, f)
	}
	js, err := json.Marshal(cfg)
	if err != nil {
		CloseFiles(opened)
		return nil, nil, err
	}
	cmd := exec.Command(fmt.Sprintf("/proc/self/fd/%d", selfFD), ConfineInitArg, string(js))
	cmd.Env = []string{}
	cmd.ExtraFiles = extra
	// uid and gid 0 of the namespace are the program's host uid; the
	// host's supplementary groups are dropped.
	hostID := c.UID
	cred := &syscall.Credential{Uid: 0, Gid: 0, Groups: []uint32{}}
	if !root {
		// An unprivileged user may map only its own ids, and only
		// with setgroups denied (the groups stay the user's).
		hostID = os.Getuid()
		cred.NoSetGroups = true
	}
	gid := hostID
	if !root {
		gid = os.Getgid()
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: unix.CLONE_NEWUSER | unix.CLONE_NEWNS | unix.CLONE_NEWPID |
			unix.CLONE_NEWNET | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS,
		Pdeathsig:                  syscall.SIGKILL,
		Setpgid:                    true,
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostID, Size: 1}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: gid, Size: 1}},
		GidMappingsEnableSetgroups: root,
		Credential:                 cred,
	}
	return cmd, opened, nil
}

// CloseFiles closes each of fs (nil ones are fine: os.File.Close
// returns an error for them, which is dropped).
func CloseFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// MaybeConfineInit runs the confinement init and never returns when the
// process was started as one; otherwise it returns at once. Every binary
// that starts confined programs (cmd/kiln through the backends' MaybeInit,
// their test binaries) calls it first thing.
func MaybeConfineInit() {
	if len(os.Args) < 3 || os.Args[1] != ConfineInitArg {
		return
	}
	runtime.LockOSThread()
	err := runConfineInit(os.Args[2])
	fmt.Fprintf(os.Stderr, "kiln confine init: %v\n", err)
	os.Exit(1)
}

// confineRoot is where the init builds the new root, in its own mount
// namespace: any directory every uid can reach will do.
const confineRoot = "/tmp"

func runConfineInit(arg string) error {
	var cfg confineConfig
	if err := json.Unmarshal([]byte(arg), &cfg); err != nil {
		return fmt.Errorf("reading config: %w", err)
	}
	steps := []struct {
		name string
		fn   func(*confineConfig) error
	}{
		{"building root", buildConfinedRoot},
		{"entering root", enterConfinedRoot},
		// Marked close-on-exec, not closed: the Go runtime's own
		// descriptors (its epoll instance) are among them.
		{"closing descriptors", func(c *confineConfig) error {
			return unix.CloseRange(uint(c.CloseFrom), ^uint(0), unix.CLOSE_RANGE_CLOEXEC)
		}},
		{"dropping privileges", dropConfinedPrivileges},
		{"loading seccomp filter", loadConfinedSeccomp},
	}
	for _, s := range steps {
		if err := s.fn(&cfg); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	argv := append([]string{filepath.Base(cfg.Exe)}, cfg.Args...)
	return fmt.Errorf("executing %s: %w", cfg.Exe, unix.Exec(cfg.Exe, argv, cfg.Env))
}

func buildConfinedRoot(cfg *confineConfig) error {
	if err := mountCall("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return err
	}
	var held []*os.File
	defer func() { CloseFiles(held) }()
	for i, m := range cfg.Mounts {
		if !m.Detach {
			continue
		}
		f, err := detachedBind(Bind{Src: m.Src, RW: m.RW, Dev: m.Dev})
		if err != nil {
			return err
		}
		held = append(held, f)
		cfg.Mounts[i].FD = int(f.Fd())
	}
	const hard = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	if err := mountCall("tmpfs", confineRoot, "tmpfs", hard, "mode=755,size=1m,nr_inodes=256"); err != nil {
		return err
	}
	for _, m := range cfg.Mounts {
		dst := filepath.Join(confineRoot, m.Dst)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if m.Symlink != "" {
			if err := os.Symlink(m.Symlink, dst); err != nil {
				return err
			}
			continue
		}
		if m.Dir {
			if err := os.Mkdir(dst, 0o755); err != nil {
				return err
			}
		} else if err := os.WriteFile(dst, nil, 0o644); err != nil {
			return err
		}
		if m.FD != 0 {
			// A detached bind kiln made: attach it.
			if err := unix.MoveMount(m.FD, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
				return fmt.Errorf("attaching %s: %w", m.Dst, err)
			}
			continue
		}
		if err := mountCall(m.Src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return err
		}
		flags := uintptr(unix.MS_NOSUID)
		if !m.Dev {
			flags |= unix.MS_NODEV
		}
		if !m.RW {
			flags |= unix.MS_RDONLY
		}
		if err := remountBind(dst, flags); err != nil {
			return err
		}
	}
	if cfg.Proc {
		// The program's own proc, which shows only its own pid
		// namespace (QEMU opens the guest RAM as /proc/self/fd/N).
		proc := filepath.Join(confineRoot, "proc")
		if err := os.Mkdir(proc, 0o555); err != nil {
			return err
		}
		if err := mountCall("proc", proc, "proc", hard, ""); err != nil {
			return err
		}
	}
	return mountCall("", confineRoot, "", unix.MS_REMOUNT|unix.MS_RDONLY|hard, "")
}

// remountBind applies flags to a bind mount, keeping the flags the kernel
// locks in a user namespace (nodev, noexec, atime) from the source.
func remountBind(dst string, flags uintptr) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dst, &st); err != nil {
		return err
	}
	locked := uintptr(st.Flags) & (unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_NOATIME | unix.MS_NODIRATIME | unix.MS_RELATIME)
	return mountCall("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|flags|locked, "")
}

func mountCall(src, dst, fstype string, flags uintptr, data string) error {
	if err := unix.Mount(src, dst, fstype, flags, data); err != nil {
		return fmt.Errorf("mounting %s on %s: %w", src, dst, err)
	}
	return nil
}

func enterConfinedRoot(cfg *confineConfig) error {
	if err := unix.Chdir(confineRoot); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	// The old root is stacked under the new one: detach it.
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detaching old root: %w", err)
	}
	dir := cfg.Dir
	if dir == "" {
		dir = "/"
	}
	return unix.Chdir(dir)
}

// Securebits that make uid 0 of the namespace an ordinary uid for good.
const confineSecurebits = 1<<0 | 1<<1 | // SECBIT_NOROOT, _LOCKED
	1<<2 | 1<<3 | // SECBIT_NO_SETUID_FIXUP, _LOCKED
	1<<5 | // SECBIT_KEEP_CAPS_LOCKED (off)
	1<<6 | 1<<7 // SECBIT_NO_CAP_AMBIENT_RAISE, _LOCKED

func dropConfinedPrivileges(*confineConfig) error {
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, confineSecurebits, 0, 0, 0); err != nil {
		return fmt.Errorf("setting securebits: %w", err)
	}
	if err := DropBounding(0); err != nil {
		return err
	}
	if err := SetCaps(0, 0); err != nil {
		return err
	}
	return unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
}

// loadConfinedSeccomp loads the program's filter on the init's thread,
// the one that execs it (the exec ends the others). From here on the
// init's own calls go through it.
func loadConfinedSeccomp(cfg *confineConfig) error {
	if cfg.Seccomp == nil {
		return nil
	}
	filter := make([]unix.SockFilter, len(cfg.Seccomp))
	for i, r := range cfg.Seccomp {
		filter[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	flags := uintptr(0)
	if cfg.NotifyFD != 0 {
		flags = unix.SECCOMP_FILTER_FLAG_NEW_LISTENER
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	_, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, flags, uintptr(unsafe.Pointer(&prog)))
	runtime.KeepAlive(filter)
	if errno != 0 {
		return fmt.Errorf("loading filter: %w", errno)
	}
	if cfg.NotifyFD != 0 {
		// The listener is close-on-exec: wait until the caller has
		// taken it.
		var b [1]byte
		unix.Read(cfg.NotifyFD, b[:])
	}
	return nil
}

// detachedBind makes a detached bind mount of b.Src with b's flags.
func detachedBind(b Bind) (*os.File, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, b.Src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("binding %s: %w", b.Src, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID}
	if !b.Dev {
		attr.Attr_set |= unix.MOUNT_ATTR_NODEV
	}
	if !b.RW {
		attr.Attr_set |= unix.MOUNT_ATTR_RDONLY
	}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("binding %s: %w", b.Src, err)
	}
	return os.NewFile(uintptr(fd), b.Src), nil
}
