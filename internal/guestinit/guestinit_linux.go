package guestinit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
)

// Filesystem magic numbers of an initramfs root.
const (
	ramfsMagic = 0x858458f6
	tmpfsMagic = 0x01021994
)

// portWait bounds how long Setup waits for a device to appear. It is
// generous: under TCG a module probe takes seconds.
const portWait = 60 * time.Second

// Setup prepares the guest and returns the path of the character device
// that carries the agent protocol to the host. In the initramfs it switches
// to the real root and re-executes AgentPath; it returns only on error there.
func Setup() (stream string, err error) {
	if os.Getpid() != 1 {
		return "", errors.New("guestinit: not running as PID 1")
	}
	var st unix.Statfs_t
	if err := unix.Statfs("/", &st); err != nil {
		return "", fmt.Errorf("inspecting root: %w", err)
	}
	if st.Type == ramfsMagic || st.Type == tmpfsMagic {
		return "", switchRoot()
	}
	return setupRoot()
}

// switchRoot is stage 1: load modules, mount the root disk, move onto it
// and exec the agent from it.
func switchRoot() error {
	for _, m := range []mount{
		{"proc", "/proc", "proc", msNosuid | msNodev | msNoexec, ""},
		{"sysfs", "/sys", "sysfs", msNosuid | msNodev | msNoexec, ""},
		{"devtmpfs", "/dev", "devtmpfs", msNosuid | msNoexec, "mode=0755"},
	} {
		if err := doMount(m); err != nil {
			return err
		}
	}
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return fmt.Errorf("reading kernel command line: %w", err)
	}
	p := ParseCmdline(string(cmdline))
	if err := loadModules(); err != nil {
		return err
	}
	if err := waitFor(p.Root); err != nil {
		return err
	}
	const newRoot = "/newroot"
	if err := os.MkdirAll(newRoot, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", newRoot, err)
	}
	if err := unix.Mount(p.Root, newRoot, p.RootFSType, unix.MS_RDONLY, ""); err != nil {
		return fmt.Errorf("mounting root %s (%s): %w", p.Root, p.RootFSType, err)
	}
	for _, t := range []string{"/proc", "/sys", "/dev"} {
		if err := unix.Unmount(t, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmounting %s: %w", t, err)
		}
	}
	// Free the initramfs: nothing in it is needed once we exec.
	entries, _ := os.ReadDir("/")
	for _, e := range entries {
		if e.Name() != "newroot" {
			os.RemoveAll("/" + e.Name())
		}
	}
	if err := os.Chdir(newRoot); err != nil {
		return fmt.Errorf("entering new root: %w", err)
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("moving new root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("changing root: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return fmt.Errorf("entering root: %w", err)
	}
	argv := append([]string{AgentPath}, os.Args[1:]...)
	if err := unix.Exec(AgentPath, argv, os.Environ()); err != nil {
		return fmt.Errorf("executing %s: %w", AgentPath, err)
	}
	return nil
}

func loadModules() error {
	b, err := os.ReadFile(ModulesFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading module list: %w", err)
	}
	for _, path := range ParseModules(string(b)) {
		f, err := os.Open(path)
		if err != nil {
			return fmt.Errorf("loading module: %w", err)
		}
		err = unix.FinitModule(int(f.Fd()), "", 0)
		f.Close()
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("loading module %s: %w", filepath.Base(path), err)
		}
	}
	return nil
}

func waitFor(path string) error {
	deadline := time.Now().Add(portWait)
	for {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("waiting for %s: %w", path, os.ErrNotExist)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// setupRoot is stage 2.
func setupRoot() (string, error) {
	cmdline, err := readCmdline()
	if err != nil {
		return "", err
	}
	p := ParseCmdline(cmdline)
	if p.Plan == nil {
		return "", ErrNoPlan
	}
	for _, m := range mounts(p.Plan) {
		if err := doMount(m); err != nil {
			return "", err
		}
	}
	if err := mountTemplate(cmdline); err != nil {
		return "", err
	}
	for name, target := range map[string]string{
		"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0",
		"/dev/stdout": "/proc/self/fd/1", "/dev/stderr": "/proc/self/fd/2",
	} {
		os.Symlink(target, name)
	}
	if err := unix.Sethostname([]byte(p.Plan.Hostname)); err != nil {
		return "", fmt.Errorf("setting hostname: %w", err)
	}
	if err := linkUp("lo"); err != nil {
		return "", err
	}
	if err := setupNetwork(p.Plan.Network); err != nil {
		return "", err
	}
	// Inherited by everything the agent starts. Root ignores NPROC, so it
	// bounds only the unprivileged user that runs the code.
	for _, rl := range p.Plan.Rlimits {
		res, _ := boxpolicy.RlimitResource(rl.Name) // decodePlan took only its names
		if err := unix.Setrlimit(res, &unix.Rlimit{Cur: rl.Value, Max: rl.Value}); err != nil {
			return "", fmt.Errorf("setting %s: %w", rl.Name, err)
		}
	}
	// The agent's environment, and so the code's: the plan's and the code
	// user's names (USER, LOGNAME), as on every backend, not the kernel's
	// (HOME=/, TERM=linux); the template's on top (mountTemplate).
	os.Clearenv()
	for _, kv := range slices.Concat(p.Plan.Env, boxpolicy.UserEnv(codeUID(p.Plan)), templateEnv(cmdline)) {
		k, v, _ := strings.Cut(kv, "=")
		os.Setenv(k, v)
	}
	if err := codeCgroup(p); err != nil {
		return "", err
	}
	for _, sc := range sysctls {
		err := os.WriteFile("/proc/sys/"+sc.key, []byte(sc.value), 0)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("setting sysctl %s: %w", sc.key, err)
		}
	}
	if p.Transport == "vsock" {
		if err := serveSeedVsock(SeedVsockPort, p.Plan.Network); err != nil {
			return "", err
		}
		return vsockStream(p.VsockPort)
	}
	stream, err := findPort(p.Port)
	if err != nil {
		return "", err
	}
	// The seed port sits on the same device as the agent's: it is there
	// by now if the host gave one.
	if seed, err := lookupPort(SeedPortName); err == nil {
		if err := serveSeed(seed, p.Plan.Network); err != nil {
			return "", err
		}
	}
	return stream, nil
}

// readCmdline reads the kernel command line, mounting /proc plainly
// for it if it is not mounted yet (the mount table mounts it again, with
// hidepid).
func readCmdline() (string, error) {
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err == nil {
		return string(cmdline), nil
	}
	if err := doMount(mount{"proc", "/proc", "proc", msNosuid | msNodev | msNoexec, ""}); err != nil {
		return "", err
	}
	cmdline, err = os.ReadFile("/proc/cmdline")
	unix.Unmount("/proc", unix.MNT_DETACH)
	if err != nil {
		return "", fmt.Errorf("reading kernel command line: %w", err)
	}
	return string(cmdline), nil
}

// PlanDigest is the digest of the box plan on this guest's kernel command
// line, which stage 2 built the box from (it fails without one): the
// serving agent announces it in its hello, and the host refuses a guest
// that does not.
func PlanDigest() (string, error) {
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return "", fmt.Errorf("reading kernel command line: %w", err)
	}
	p := ParseCmdline(string(cmdline))
	if p.Plan == nil {
		return "", ErrNoPlan
	}
	return p.Plan.Digest(), nil
}

// codeCgroup mounts cgroup2 and makes CodeCgroup with the box's limits.
func codeCgroup(p Params) error {
	const root = "/sys/fs/cgroup"
	if err := unix.Mount("cgroup2", root, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "nsdelegate"); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mounting cgroup2: %w", err)
	}
	if err := os.WriteFile(root+"/cgroup.subtree_control", []byte("+memory +pids"), 0); err != nil {
		return fmt.Errorf("enabling cgroup controllers: %w", err)
	}
	if err := os.Mkdir(CodeCgroup, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("creating code cgroup: %w", err)
	}
	for _, f := range codeCgroupFiles(p) {
		if err := os.WriteFile(CodeCgroup+"/"+f.file, []byte(f.value), 0); err != nil {
			return fmt.Errorf("limiting code cgroup: %s: %w", f.file, err)
		}
	}
	return nil
}

func doMount(m mount) error {
	if m.flags&msBind != 0 {
		return doBind(m)
	}
	if err := os.MkdirAll(m.target, 0o755); err != nil && !errors.Is(err, unix.EROFS) {
		return fmt.Errorf("creating %s: %w", m.target, err)
	}
	err := unix.Mount(m.source, m.target, m.fstype, m.flags, m.data)
	if errors.Is(err, unix.EBUSY) {
		return nil // already mounted (devtmpfs automount)
	}
	if err != nil {
		return fmt.Errorf("mounting %s on %s: %w", m.fstype, m.target, err)
	}
	return nil
}

// doBind binds m.source over m.target, which exists (or the bind is
// skipped), then applies m's other flags to the bind.
func doBind(m mount) error {
	if _, err := os.Stat(m.target); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := unix.Mount(m.source, m.target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("binding %s on %s: %w", m.source, m.target, err)
	}
	if err := unix.Mount("", m.target, "", unix.MS_BIND|unix.MS_REMOUNT|m.flags, ""); err != nil {
		return fmt.Errorf("binding %s on %s: %w", m.source, m.target, err)
	}
	return nil
}

// findPort finds the virtio-serial port by name in sysfs (there is no udev
// to make /dev/virtio-ports/<name>) and returns its device node.
func findPort(name string) (string, error) {
	deadline := time.Now().Add(portWait)
	for {
		if dev, err := lookupPort(name); err == nil {
			return dev, nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("finding virtio-serial port %q: %w", name, os.ErrNotExist)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// lookupPort returns the device of the named virtio-serial port, if any.
func lookupPort(name string) (string, error) {
	dirs, _ := filepath.Glob("/sys/class/virtio-ports/*")
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "name"))
		if err != nil || strings.TrimSpace(string(b)) != name {
			continue
		}
		dev := "/dev/" + filepath.Base(d)
		if _, err := os.Stat(dev); err == nil {
			return dev, nil
		}
	}
	return "", os.ErrNotExist
}

// PowerOff flushes and powers the guest off. It returns only if the kernel
// refused; the host then kills the VM.
func PowerOff() error {
	unix.Sync()
	err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	// With -no-reboot, a restart ends the VM too.
	if err2 := unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART); err2 != nil {
		err = errors.Join(err, err2)
	}
	return fmt.Errorf("powering off: %w", err)
}

// codeUID is the user the code runs as: the owner of the plan's workspace.
func codeUID(plan *boxpolicy.Plan) int {
	for _, t := range plan.Tmpfs {
		if t.Path == plan.Workspace && t.UID >= 0 {
			return t.UID
		}
	}
	return boxpolicy.UID
}
