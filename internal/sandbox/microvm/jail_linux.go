package microvm

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox/boxkit"
)

// QEMU is jailed as boxkit confines a runtime kiln runs on the host: its
// own user, mount, pid, net, ipc and uts namespaces, as a host uid no real
// user has, in a root that holds only what QEMU needs, with no capability
// and no way to gain one; QEMU then applies its own seccomp filter
// (-sandbox).

// Inside the new root.
const (
	jailVMDir  = "/vm"  // kernel, initrd, rootfs
	jailLogDir = "/log" // the console log, the only writable place
)

// MaybeInit runs QEMU's jail init (boxkit's confinement init) and never
// returns when the process was started as one; otherwise it returns at
// once. cmd/kiln (and test binaries that start jailed VMs) call it first
// thing.
func MaybeInit() { boxkit.MaybeConfineInit() }

// jailCommand returns the command that runs exe with args jailed as host
// uid, with files as its descriptors from 3 on (nil for a hole) and
// binds, and the descriptors it opened, which the caller closes once the
// command has started. self is kiln's own executable, open.
func jailCommand(self *os.File, uid int, exe string, args []string, files []*os.File, binds []boxkit.Bind) (*exec.Cmd, []*os.File, error) {
	return boxkit.Confined{
		UID:   uid,
		Exe:   exe,
		Args:  args,
		Files: files,
		Binds: binds,
		Proc:  true, // QEMU opens the guest RAM as /proc/self/fd/N
	}.Command(self)
}

// jailedQEMU returns the command that runs cfg's QEMU jailed as a host uid
// of its own, and the descriptors to close once it has started.
func (b *Backend) jailedQEMU(v *vm, cfg vmConfig, files []*os.File) (*exec.Cmd, []*os.File, error) {
	_, uid := b.vmmUIDs.Next()
	qemu, err := filepath.EvalSymlinks(cfg.QEMU)
	if err != nil {
		return nil, nil, err
	}
	if !boxkit.ConfinedSees(qemu) {
		return nil, nil, fmt.Errorf("%s: a jailed QEMU must live where its jail shows the host's runtime (%s)", qemu, strings.Join(boxkit.ConfinedHostDirs, ", "))
	}
	logDir := filepath.Join(v.dir, "log")
	if err := os.Mkdir(logDir, 0o700); err != nil {
		return nil, nil, err
	}
	if err := os.Chown(logDir, uid, uid); err != nil {
		return nil, nil, err
	}
	v.console = filepath.Join(logDir, "console.log")
	binds := []boxkit.Bind{
		{Src: cfg.Kernel, Dst: jailVMDir + "/kernel"},
		{Src: cfg.Initrd, Dst: jailVMDir + "/initrd"},
		{Src: cfg.Rootfs, Dst: jailVMDir + "/rootfs"},
		{Src: logDir, Dst: jailLogDir, Dir: true, RW: true},
	}
	cfg.Kernel, cfg.Initrd, cfg.Rootfs = jailVMDir+"/kernel", jailVMDir+"/initrd", jailVMDir+"/rootfs"
	if cfg.Template != "" {
		binds = append(binds, boxkit.Bind{Src: cfg.Template, Dst: jailVMDir + "/template"})
		cfg.Template = jailVMDir + "/template"
	}
	cfg.Console = jailLogDir + "/console.log"
	if cfg.Accel == AccelKVM {
		node, err := kvmNode(v.dir, uid)
		if err != nil {
			return nil, nil, err
		}
		binds = append(binds, boxkit.Bind{Src: node, Dst: "/dev/kvm", Dev: true})
	}
	self, err := os.Open(b.self)
	if err != nil {
		return nil, nil, fmt.Errorf("opening own executable: %w", err)
	}
	// QEMU's descriptors are fixed (fdAgent..fdMem): holes up to fdMem.
	files = append([]*os.File{}, files...)
	for len(files) < fdMem+1-3 {
		files = append(files, nil)
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
