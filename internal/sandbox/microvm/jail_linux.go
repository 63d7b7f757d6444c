package microvm

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox/boxplan"
)

// QEMU is jailed the way Firecracker's jailer does it: kiln re-executes
// itself with InitArg (the re-exec init pattern) in new user, mount, pid,
// net, ipc and uts namespaces, as a host uid no real user has; the init
// builds a root that holds only what QEMU needs, pivots into it, drops
// every capability (empty bounding set, locked securebits, no_new_privs)
// and execs QEMU, which then applies its own seccomp filter.
//
// The init's uid cannot resolve kiln's root-owned paths (the image cache,
// the run directory), so kiln makes a detached bind mount of each file
// QEMU needs and the init attaches the inherited mount at a path in the
// new root.

// InitArg is the hidden first argument of the jail init.
const InitArg = "__kiln_microvm_init"

// Host uids of jailed QEMU processes: one per VM, from a range no real user
// or /etc/subuid entry has, and above the jail backend's (1<<30 plus 4096
// ranges of 65536).
const (
	vmmUIDBase  = 1<<30 + 1<<28
	vmmUIDSlots = 1 << 16
)

// Inside the new root.
const (
	jailVMDir  = "/vm"  // kernel, initrd, rootfs
	jailLogDir = "/log" // the console log, the only writable place
)

// jailFD is the first descriptor the init uses for itself; those below it
// (stdio, the QEMU streams, fdAgent..fdMem) are QEMU's. Everything from
// jailFD on is closed when the init execs QEMU.
const jailFD = fdMem + 1

// jailHostDirs are the host paths QEMU's root gets read-only: its binary,
// libraries, modules and firmware. A path that is a symlink on the host
// (merged /usr) becomes the same symlink.
var jailHostDirs = []string{"/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache"}

// jailDevices are the host device nodes bound into the root, read-only
// mounts (which do not stop a device from being opened for writing).
var jailDevices = []string{"/dev/null", "/dev/zero", "/dev/urandom"}

// jailConfig travels from kiln to the init as its second argument.
type jailConfig struct {
	Exe    string      `json:"exe"` // the program, a path in the new root
	Args   []string    `json:"args"`
	Env    []string    `json:"env"`
	Mounts []jailMount `json:"mounts"`
}

// jailMount is one entry of the new root: a bind of a host path or of an
// inherited descriptor, or a symlink.
type jailMount struct {
	Dst     string `json:"dst"`
	Src     string `json:"src,omitempty"` // host path
	FD      int    `json:"fd,omitempty"`  // or an inherited descriptor
	Symlink string `json:"symlink,omitempty"`
	Dir     bool   `json:"dir,omitempty"`
	RW      bool   `json:"rw,omitempty"`
	Dev     bool   `json:"dev,omitempty"` // a device node: keep dev
}

// jailFile is a host path the init binds at a path in the new root: kiln
// makes a detached bind mount of it (open_tree), whose descriptor the init
// attaches (move_mount). The init's uid could not resolve the path, and a
// descriptor of a mount of kiln's namespace could not be bound in the
// init's.
type jailFile struct {
	src string
	dst string
	dir bool
	rw  bool
	dev bool
}

// jailCommand returns the command that runs exe with args in a jail as
// host uid, with files (its descriptors from 3 on, nil for a hole) and
// binds, and the descriptors it opened for them, which the caller closes
// once the command has started. self is kiln's own executable, open.
func jailCommand(self *os.File, uid int, exe string, args []string, files []*os.File, binds []jailFile) (_ *exec.Cmd, opened []*os.File, _ error) {
	cfg := jailConfig{Exe: exe, Args: args, Env: []string{"PATH=/usr/bin:/bin"}}
	for _, p := range jailHostDirs {
		fi, err := os.Lstat(p)
		switch {
		case err != nil:
			continue
		case fi.Mode()&os.ModeSymlink != 0:
			l, err := os.Readlink(p)
			if err != nil {
				return nil, nil, fmt.Errorf("reading %s: %w", p, err)
			}
			cfg.Mounts = append(cfg.Mounts, jailMount{Dst: p, Symlink: l})
		default:
			cfg.Mounts = append(cfg.Mounts, jailMount{Dst: p, Src: p, Dir: fi.IsDir()})
		}
	}
	for _, d := range jailDevices {
		cfg.Mounts = append(cfg.Mounts, jailMount{Dst: d, Src: d, Dev: true})
	}
	extra := slices.Clone(files)
	for len(extra) < jailFD-3 {
		extra = append(extra, nil)
	}
	extra = append(extra, self)
	for _, b := range binds {
		f, err := detachedBind(b)
		if err != nil {
			closeFiles(opened)
			return nil, nil, err
		}
		opened = append(opened, f)
		cfg.Mounts = append(cfg.Mounts, jailMount{Dst: b.dst, FD: 3 + len(extra), Dir: b.dir, RW: b.rw, Dev: b.dev})
		extra = append(extra, f)
	}
	js, err := json.Marshal(cfg)
	if err != nil {
		closeFiles(opened)
		return nil, nil, err
	}
	cmd := exec.Command(fmt.Sprintf("/proc/self/fd/%d", jailFD), InitArg, string(js))
	cmd.Env = []string{}
	cmd.ExtraFiles = extra
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: unix.CLONE_NEWUSER | unix.CLONE_NEWNS | unix.CLONE_NEWPID |
			unix.CLONE_NEWNET | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS,
		Pdeathsig: syscall.SIGKILL,
		Setpgid:   true,
		// uid and gid 0 of the namespace are the VM's host uid; the
		// host's supplementary groups are dropped.
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: uid, Size: 1}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: uid, Size: 1}},
		GidMappingsEnableSetgroups: true,
		Credential:                 &syscall.Credential{Uid: 0, Gid: 0, Groups: []uint32{}},
	}
	return cmd, opened, nil
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// MaybeInit runs the jail init and never returns when the process was
// started as one; otherwise it returns at once. cmd/kiln (and test
// binaries that start jailed VMs) call it first thing in main.
func MaybeInit() {
	if len(os.Args) < 3 || os.Args[1] != InitArg {
		return
	}
	runtime.LockOSThread()
	err := runJailInit(os.Args[2])
	fmt.Fprintf(os.Stderr, "kiln microvm init: %v\n", err)
	os.Exit(1)
}

// jailRoot is where the init builds the new root, in its own mount
// namespace: any directory every uid can reach will do.
const jailRoot = "/tmp"

func runJailInit(arg string) error {
	var cfg jailConfig
	if err := json.Unmarshal([]byte(arg), &cfg); err != nil {
		return fmt.Errorf("reading config: %w", err)
	}
	steps := []struct {
		name string
		fn   func(*jailConfig) error
	}{
		{"building root", buildJailRoot},
		{"entering root", enterJailRoot},
		// Marked close-on-exec, not closed: the Go runtime's own
		// descriptors (its epoll instance) are among them.
		{"closing descriptors", func(*jailConfig) error { return unix.CloseRange(jailFD, ^uint(0), unix.CLOSE_RANGE_CLOEXEC) }},
		{"dropping privileges", dropJailPrivileges},
	}
	for _, s := range steps {
		if err := s.fn(&cfg); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	argv := append([]string{filepath.Base(cfg.Exe)}, cfg.Args...)
	return fmt.Errorf("executing %s: %w", cfg.Exe, unix.Exec(cfg.Exe, argv, cfg.Env))
}

func buildJailRoot(cfg *jailConfig) error {
	if err := jailMountCall("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return err
	}
	const hard = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	if err := jailMountCall("tmpfs", jailRoot, "tmpfs", hard, "mode=755,size=1m,nr_inodes=256"); err != nil {
		return err
	}
	for _, m := range cfg.Mounts {
		dst := filepath.Join(jailRoot, m.Dst)
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
		if err := jailMountCall(m.Src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
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
	// QEMU opens the guest RAM as /proc/self/fd/N: its own proc, which
	// shows only its own pid namespace.
	proc := filepath.Join(jailRoot, "proc")
	if err := os.Mkdir(proc, 0o555); err != nil {
		return err
	}
	if err := jailMountCall("proc", proc, "proc", hard, ""); err != nil {
		return err
	}
	return jailMountCall("", jailRoot, "", unix.MS_REMOUNT|unix.MS_RDONLY|hard, "")
}

// remountBind applies flags to a bind mount, keeping the flags the kernel
// locks in a user namespace (nodev, noexec, atime) from the source.
func remountBind(dst string, flags uintptr) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dst, &st); err != nil {
		return err
	}
	locked := uintptr(st.Flags) & (unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_NOATIME | unix.MS_NODIRATIME | unix.MS_RELATIME)
	return jailMountCall("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|flags|locked, "")
}

func jailMountCall(src, dst, fstype string, flags uintptr, data string) error {
	if err := unix.Mount(src, dst, fstype, flags, data); err != nil {
		return fmt.Errorf("mounting %s on %s: %w", src, dst, err)
	}
	return nil
}

func enterJailRoot(*jailConfig) error {
	if err := unix.Chdir(jailRoot); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	// The old root is stacked under the new one: detach it.
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detaching old root: %w", err)
	}
	return unix.Chdir("/")
}

// Securebits that make uid 0 of the namespace an ordinary uid for good.
const jailSecurebits = 1<<0 | 1<<1 | // SECBIT_NOROOT, _LOCKED
	1<<2 | 1<<3 | // SECBIT_NO_SETUID_FIXUP, _LOCKED
	1<<5 | // SECBIT_KEEP_CAPS_LOCKED (off)
	1<<6 | 1<<7 // SECBIT_NO_CAP_AMBIENT_RAISE, _LOCKED

func dropJailPrivileges(*jailConfig) error {
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, jailSecurebits, 0, 0, 0); err != nil {
		return fmt.Errorf("setting securebits: %w", err)
	}
	if err := boxplan.DropBounding(0); err != nil {
		return err
	}
	if err := boxplan.SetCaps(0, 0); err != nil {
		return err
	}
	return unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
}

// jailedQEMU returns the command that runs cfg's QEMU jailed as a host uid
// of its own, and the descriptors to close once it has started.
func (b *Backend) jailedQEMU(v *vm, cfg vmConfig, files []*os.File) (*exec.Cmd, []*os.File, error) {
	uid := vmmUIDBase + int(b.uidSlot.Add(1)%vmmUIDSlots)
	qemu, err := filepath.EvalSymlinks(cfg.QEMU)
	if err != nil {
		return nil, nil, err
	}
	if !strings.HasPrefix(qemu, "/usr/") {
		return nil, nil, fmt.Errorf("%s: a jailed QEMU must live under /usr", qemu)
	}
	logDir := filepath.Join(v.dir, "log")
	if err := os.Mkdir(logDir, 0o700); err != nil {
		return nil, nil, err
	}
	if err := os.Chown(logDir, uid, uid); err != nil {
		return nil, nil, err
	}
	v.console = filepath.Join(logDir, "console.log")
	binds := []jailFile{
		{src: cfg.Kernel, dst: jailVMDir + "/kernel"},
		{src: cfg.Initrd, dst: jailVMDir + "/initrd"},
		{src: cfg.Rootfs, dst: jailVMDir + "/rootfs"},
		{src: logDir, dst: jailLogDir, dir: true, rw: true},
	}
	cfg.Kernel, cfg.Initrd, cfg.Rootfs = jailVMDir+"/kernel", jailVMDir+"/initrd", jailVMDir+"/rootfs"
	if cfg.Template != "" {
		binds = append(binds, jailFile{src: cfg.Template, dst: jailVMDir + "/template"})
		cfg.Template = jailVMDir + "/template"
	}
	cfg.Console = jailLogDir + "/console.log"
	if cfg.Accel == AccelKVM {
		node, err := kvmNode(v.dir, uid)
		if err != nil {
			return nil, nil, err
		}
		binds = append(binds, jailFile{src: node, dst: "/dev/kvm", dev: true})
	}
	self, err := os.Open(b.self)
	if err != nil {
		return nil, nil, fmt.Errorf("opening own executable: %w", err)
	}
	cmd, opened, err := jailCommand(self, uid, qemu, cfg.args(), files, binds)
	if err != nil {
		self.Close()
		return nil, nil, err
	}
	return cmd, append(opened, self), nil
}

// kvmNode makes a /dev/kvm node in dir that only uid may open (as
// Firecracker's jailer does): the host's belongs to root.
func kvmNode(dir string, uid int) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat("/dev/kvm", &st); err != nil {
		return "", fmt.Errorf("%w: %v", ErrNoKVM, err)
	}
	node := filepath.Join(dir, "kvm")
	if err := unix.Mknod(node, unix.S_IFCHR|0o600, int(st.Rdev)); err != nil {
		return "", fmt.Errorf("making kvm node: %w", err)
	}
	if err := os.Chown(node, uid, uid); err != nil {
		return "", fmt.Errorf("making kvm node: %w", err)
	}
	return node, nil
}

// detachedBind makes a detached bind mount of b.src with b's flags.
func detachedBind(b jailFile) (*os.File, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, b.src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("binding %s: %w", b.src, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID}
	if !b.dev {
		attr.Attr_set |= unix.MOUNT_ATTR_NODEV
	}
	if !b.rw {
		attr.Attr_set |= unix.MOUNT_ATTR_RDONLY
	}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("binding %s: %w", b.src, err)
	}
	return os.NewFile(uintptr(fd), b.src), nil
}
