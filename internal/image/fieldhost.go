package image

import (
	"log/slog"
	"path/filepath"
	"slices"
	"strconv"
)

// A field host is a whole Debian system booted in QEMU to test kiln on the
// kind of machine its users have (issue 24): systemd as PID 1 on cgroup v2
// alone, Landlock in the LSM list, user namespaces, and an ordinary login
// user with subordinate id ranges, lingering, and a user manager with
// delegated controllers. Unlike the microVM image it boots Debian's own
// kernel and initramfs, and its root filesystem is writable (QEMU keeps
// the writes in a snapshot, so the cached file never changes).

// fieldHostRecipe versions the field host's build steps.
const fieldHostRecipe = 1

// FieldHostUser is the field host's ordinary login user and its uid.
const (
	FieldHostUser = "kiln"
	FieldHostUID  = 1000
)

// FieldHostTestLabel is the file system label of the disk the harness
// attaches with the test binaries; the guest mounts it at FieldHostTestDir
// and runs FieldHostTestDir/run when it is there.
const (
	FieldHostTestLabel = "fieldhost"
	FieldHostTestDir   = "/fieldhost"
)

// FieldHostPackages are installed on top of debootstrap's minbase: the
// kernel, systemd with logind and a user bus, the subordinate-id tools, the
// box runtime (DefaultPackages) and what the suites use.
var FieldHostPackages = append([]string{
	"linux-image-amd64", "systemd", "systemd-sysv", "dbus", "dbus-user-session", "libpam-systemd",
	"uidmap", "iproute2", "nftables", "curl", "procps", "kmod",
}, DefaultPackages...)

// FieldHostCmdline is the kernel command line: cgroup v2 alone, Landlock
// first in the LSM list, the console on the first serial port.
const FieldHostCmdline = "console=ttyS0 root=LABEL=fieldhost-root rw panic=-1 " +
	"systemd.unified_cgroup_hierarchy=1 cgroup_no_v1=all lsm=landlock,lockdown,yama,apparmor,bpf " +
	"systemd.show_status=error"

// FieldHostOptions select what to build. Zero fields take defaults.
type FieldHostOptions struct {
	// CacheDir holds built field hosts; default os.UserCacheDir()/kiln/fieldhost.
	CacheDir string
	// Suite is the Debian release; default "bookworm".
	Suite string
	// Mirror is the Debian archive; default the host's first apt source,
	// else debootstrap's own default.
	Mirror string
	// Packages are installed on top of minbase; default FieldHostPackages.
	Packages []string
	// Logger receives progress; nil discards it.
	Logger *slog.Logger
}

// FieldHost is a built field host: the files QEMU boots from.
type FieldHost struct {
	Dir           string   `json:"-"`
	Key           string   `json:"key"`
	Kernel        string   `json:"kernel"` // file names, relative to Dir
	Initrd        string   `json:"initrd"`
	Rootfs        string   `json:"rootfs"`
	KernelVersion string   `json:"kernel_version"`
	Cmdline       string   `json:"cmdline"`
	Suite         string   `json:"suite"`
	Packages      []string `json:"packages"`
}

// KernelPath, InitrdPath and RootfsPath are the absolute paths of the files.
func (f *FieldHost) KernelPath() string { return filepath.Join(f.Dir, f.Kernel) }
func (f *FieldHost) InitrdPath() string { return filepath.Join(f.Dir, f.Initrd) }
func (f *FieldHost) RootfsPath() string { return filepath.Join(f.Dir, f.Rootfs) }

func (o FieldHostOptions) withDefaults() (FieldHostOptions, error) {
	if o.CacheDir == "" {
		d, err := defaultCacheDir()
		if err != nil {
			return o, err
		}
		o.CacheDir = filepath.Join(filepath.Dir(d), "fieldhost")
	}
	if o.Suite == "" {
		o.Suite = "bookworm"
	}
	if o.Mirror == "" {
		_, o.Mirror = hostAptSource()
	}
	if len(o.Packages) == 0 {
		o.Packages = FieldHostPackages
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o, nil
}

// baseKey is the content hash of what the slow part of the build reads:
// debootstrap and the packages.
func (o FieldHostOptions) baseKey() string {
	pk := slices.Clone(o.Packages)
	slices.Sort(pk)
	return hashJSON(struct {
		Recipe        int
		Suite, Mirror string
		Packages      []string
		User          string
		UID           int
	}{fieldHostRecipe, o.Suite, o.Mirror, pk, FieldHostUser, FieldHostUID})
}

// key is the content hash of everything the build reads.
func (o FieldHostOptions) key() string {
	return hashJSON(struct {
		Base, Cmdline string
		Files         map[string]string
	}{o.baseKey(), FieldHostCmdline, fieldHostFiles})
}

// fieldHostFiles are written into the field host's root filesystem, by
// path; they are part of its cache key.
var fieldHostFiles = map[string]string{
	"etc/fstab": "LABEL=fieldhost-root / ext4 rw,errors=remount-ro 0 1\n" +
		"LABEL=" + FieldHostTestLabel + " " + FieldHostTestDir + " ext4 rw,nofail,x-systemd.device-timeout=30s 0 0\n",
	"etc/hostname": "fieldhost\n",
	"etc/hosts":    "127.0.0.1\tlocalhost fieldhost\n::1\tlocalhost\n",
	// The user manager may hand these controllers to the user's own
	// units, as runc's rootless CI sets up.
	"etc/systemd/system/user@.service.d/delegate.conf": "[Service]\nDelegate=cpu cpuset io memory pids\n",
	// Lingering (loginctl enable-linger, offline): the user's manager
	// starts at boot, with no login.
	"var/lib/systemd/linger/" + FieldHostUser: "",
	// The suites' runner: the disk's run script, then power off whatever
	// it returns.
	"etc/systemd/system/kiln-fieldhost.service": `[Unit]
Description=kiln field-host suites
ConditionPathExists=` + FieldHostTestDir + `/run
RequiresMountsFor=` + FieldHostTestDir + `
After=systemd-user-sessions.service user@` + strconv.Itoa(FieldHostUID) + `.service
Wants=user@` + strconv.Itoa(FieldHostUID) + `.service

[Service]
Type=oneshot
ExecStart=` + FieldHostTestDir + `/run
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity
SuccessAction=poweroff-force
FailureAction=poweroff-force
`,
	"etc/systemd/system/multi-user.target.wants/kiln-fieldhost.service": "link:/etc/systemd/system/kiln-fieldhost.service",
	// The serial console logs in nobody; the journal stays in memory.
	"etc/systemd/journald.conf.d/volatile.conf": "[Journal]\nStorage=volatile\n",
	"etc/subuid": FieldHostUser + ":100000:65536\n",
	"etc/subgid": FieldHostUser + ":100000:65536\n",
}
