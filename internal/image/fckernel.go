package image

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
)

// vmlinuxName is the kernel's file in its cache directory.
const vmlinuxName = "vmlinux"

// kernelRecipe versions the Firecracker kernel build steps; bump it when a
// step changes what it produces.
const kernelRecipe = 1

// KernelOption is one Kconfig symbol of the Firecracker kernel (without
// the CONFIG_ prefix) and the value it must end up with: "y", "n", or a
// value as Kconfig writes it in .config.
type KernelOption struct {
	Name, Value string
}

// FirecrackerKernelConfig is applied on top of `make tinyconfig`; the build
// fails if `make olddefconfig` does not keep every option as listed (an
// option whose dependencies are unmet is dropped silently by Kconfig).
// Everything the guest needs is built in: Firecracker boots a vmlinux with
// no initramfs, finds its virtio-mmio devices on the command line, and
// kiln-agent is init on the ext4 root.
var FirecrackerKernelConfig = []KernelOption{
	// The machine: a 64-bit KVM guest without PCI or ACPI; SMP found
	// through the MP table, which Firecracker writes. PVH lets QEMU boot
	// the same vmlinux (-kernel takes an ELF only through its PVH note).
	{"64BIT", "y"},
	{"SMP", "y"},
	{"X86_MPPARSE", "y"},
	{"HYPERVISOR_GUEST", "y"},
	{"PARAVIRT", "y"},
	{"KVM_GUEST", "y"},
	{"PVH", "y"},
	{"PCI", "n"},
	{"ACPI", "n"},
	{"MODULES", "n"},
	{"CC_OPTIMIZE_FOR_PERFORMANCE", "y"}, // tinyconfig optimizes for size
	{"SLUB", "y"},                        // not SLOB: memcg needs a full allocator
	{"BASE_FULL", "y"},
	{"HIGH_RES_TIMERS", "y"},

	// Console: the serial port (console=ttyS0) and virtio-console.
	{"PRINTK", "y"},
	{"BUG", "y"},
	{"TTY", "y"},
	{"UNIX98_PTYS", "y"}, // the agent's pty bridge
	{"SERIAL_8250", "y"},
	{"SERIAL_8250_CONSOLE", "y"},

	// Devices: virtio over MMIO, declared on the command line
	// (virtio_mmio.device=…), the root disk, vsock to the host, and
	// Firecracker's entropy device.
	{"VIRTIO_MENU", "y"},
	{"VIRTIO", "y"},
	{"VIRTIO_MMIO", "y"},
	{"VIRTIO_MMIO_CMDLINE_DEVICES", "y"},
	{"BLOCK", "y"},
	{"BLK_DEV", "y"},
	{"VIRTIO_BLK", "y"},
	{"VIRTIO_CONSOLE", "y"},
	{"HW_RANDOM", "y"},
	{"HW_RANDOM_VIRTIO", "y"},
	{"NET", "y"},
	{"UNIX", "y"},
	{"INET", "y"}, // loopback, which the agent brings up
	{"VSOCKETS", "y"},
	{"VIRTIO_VSOCKETS", "y"},
	// The NIC of a box with an egress policy (Firecracker's
	// network-interfaces, on a tap leading to the gateway).
	{"NETDEVICES", "y"},
	{"NET_CORE", "y"},
	{"VIRTIO_NET", "y"},

	// Filesystems the agent mounts (package guestinit).
	{"EXT4_FS", "y"},
	{"TMPFS", "y"},
	{"SHMEM", "y"},
	{"PROC_FS", "y"},
	{"PROC_SYSCTL", "y"}, // the agent's hardening sysctls
	{"SYSFS", "y"},
	{"DEVTMPFS", "y"},
	{"DEVTMPFS_MOUNT", "y"},

	// What a Debian userland and CPython expect of the kernel; tinyconfig
	// turns all of these off.
	{"BINFMT_ELF", "y"},
	{"BINFMT_SCRIPT", "y"},
	{"MULTIUSER", "y"},
	{"FUTEX", "y"},
	{"EPOLL", "y"},
	{"SIGNALFD", "y"},
	{"TIMERFD", "y"},
	{"EVENTFD", "y"},
	{"FILE_LOCKING", "y"},
	{"POSIX_TIMERS", "y"},
	{"ADVISE_SYSCALLS", "y"},
	{"MEMBARRIER", "y"},
	{"RSEQ", "y"},
	{"SYSVIPC", "y"},

	// Confinement inside the guest: the code cgroup (memory.max,
	// memory.swap.max, which exists only with SWAP, and pids.max),
	// seccomp, and no user namespaces.
	{"CGROUPS", "y"},
	{"MEMCG", "y"},
	{"SWAP", "y"},
	{"CGROUP_PIDS", "y"},
	{"SECCOMP", "y"},
	{"SECCOMP_FILTER", "y"},
	{"USER_NS", "n"},
}

// KernelOptions select the Firecracker kernel to build. Zero fields take
// defaults.
type KernelOptions struct {
	// CacheDir holds built kernels; default the image cache dir.
	CacheDir string
	// Source is the kernel source tarball; default the newest
	// /usr/src/linux-source-*.tar.xz (Debian's linux-source package).
	Source string
	// Config is applied on top of tinyconfig; default FirecrackerKernelConfig.
	Config []KernelOption
	// Jobs is make's -j; default the number of CPUs.
	Jobs int
	// Force rebuilds even when a cached kernel matches.
	Force bool
	// Logger receives progress; nil discards it.
	Logger *slog.Logger
}

// kernelFragment renders options as .config lines, to be appended to the
// tinyconfig (the last assignment of a symbol wins).
func kernelFragment(opts []KernelOption) string {
	var b strings.Builder
	for _, o := range opts {
		if o.Value == "n" {
			fmt.Fprintf(&b, "# CONFIG_%s is not set\n", o.Name)
		} else {
			fmt.Fprintf(&b, "CONFIG_%s=%s\n", o.Name, o.Value)
		}
	}
	return b.String()
}

// parseKernelConfig reads a .config into symbol → value; symbols that are
// "not set" map to "n".
func parseKernelConfig(s string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(s, "\n") {
		line = strings.TrimSpace(line)
		if rest, ok := strings.CutPrefix(line, "# CONFIG_"); ok {
			if name, ok := strings.CutSuffix(rest, " is not set"); ok {
				m[name] = "n"
			}
			continue
		}
		if rest, ok := strings.CutPrefix(line, "CONFIG_"); ok {
			if name, value, ok := strings.Cut(rest, "="); ok {
				m[name] = value
			}
		}
	}
	return m
}

// checkKernelConfig lists the options that a .config does not have as
// wanted. An absent symbol counts as "n".
func checkKernelConfig(dotconfig string, want []KernelOption) []string {
	have := parseKernelConfig(dotconfig)
	var bad []string
	for _, o := range want {
		v, ok := have[o.Name]
		if !ok {
			v = "n"
		}
		if v != o.Value {
			bad = append(bad, fmt.Sprintf("%s=%s (want %s)", o.Name, v, o.Value))
		}
	}
	return bad
}

// CheckKernelConfig reports the options of want that the kernel config in
// dotconfig lacks, as one error; nil if it has them all.
func CheckKernelConfig(dotconfig string, want []KernelOption) error {
	if bad := checkKernelConfig(dotconfig, want); len(bad) > 0 {
		return fmt.Errorf("kernel config lacks %s", strings.Join(bad, ", "))
	}
	return nil
}

// LatestFirecrackerKernel returns the vmlinux of the Firecracker kernel
// built last in cacheDir (default: kiln's image cache), by
// BuildFirecrackerKernel (kiln image build --firecracker-kernel).
func LatestFirecrackerKernel(cacheDir string) (string, error) {
	if cacheDir == "" {
		d, err := defaultCacheDir()
		if err != nil {
			return "", err
		}
		cacheDir = d
	}
	ms, _ := filepath.Glob(filepath.Join(cacheDir, "fckernel-*", manifestName))
	var best string
	var bestTime int64
	for _, m := range ms {
		if fi, err := os.Stat(m); err == nil && fi.ModTime().UnixNano() > bestTime {
			best, bestTime = filepath.Join(filepath.Dir(m), vmlinuxName), fi.ModTime().UnixNano()
		}
	}
	if best == "" {
		return "", fmt.Errorf("no firecracker kernel in %s yet (build one with: kiln image build --firecracker-kernel)", cacheDir)
	}
	return best, nil
}
