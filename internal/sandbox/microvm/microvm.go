// Package microvm is kiln's microVM backend: every box is a QEMU microvm
// with its own guest kernel, whose PID 1 is kiln-agent (see package
// guestinit), talking to the host over virtio-serial.
//
// Boxes are not booted: per image and shape (memory, vCPUs, limits,
// preloaded modules) a template VM is booted once, waits for the agent's
// hello (Python and its libraries imported), and is saved as a migration
// stream plus a guest RAM file. Every Create starts a clone that maps that
// RAM file copy-on-write (memory-backend-file, share=off) and loads the
// small device state (x-ignore-shared), so clones share the template's
// memory until they write to it.
//
// QEMU runs jailed (jail_linux.go): a host uid of its own in its own user
// namespace, no capabilities, in a root that holds only what it needs.
// Clones of one template share its memory layout and python's hash seed,
// so a template serves a bounded number of clones for a bounded time
// (rotate_linux.go).
//
// Hardware virtualization (-accel kvm) is the default. Software emulation
// (TCG) is only for development and tests: it is slow, and it is not a
// security boundary; it must be asked for with Options.Accel = "tcg".
//
// A Firecracker driver for hosts that have it lives in firecracker.go.
package microvm

import (
	"errors"
	"log/slog"
	"regexp"
	"time"

	"kiln/internal/egress"
	"kiln/internal/image"
	"kiln/internal/sandbox"
)

// Accelerators.
const (
	AccelKVM = "kvm"
	AccelTCG = "tcg"
)

// Sentinel errors of the package.
var (
	ErrNoImage  = errors.New("microvm: no guest image (run kiln image build)")
	ErrNoKVM    = errors.New("microvm: hardware virtualization (/dev/kvm) is not usable; software emulation must be asked for explicitly (accel tcg), and is not a security boundary")
	ErrBadAccel = errors.New("microvm: accelerator must be kvm or tcg")
	ErrNoQEMU   = errors.New("microvm: qemu-system-x86_64 not found (install the Debian package qemu-system-x86)")
	// ErrOldImage is a guest whose agent did not say it built its box
	// from the plan kiln sent it: an image built before the box plan,
	// whose guest would make up its own limits.
	ErrOldImage = errors.New("microvm: the guest image's kiln-agent does not apply kiln's box plan (an image older than this kiln): rebuild it with kiln image build")
)

// Options configure the backend. Image is required; zero fields take
// defaults.
type Options struct {
	// Image is the guest image (image.Build, image.Lookup, image.Latest).
	Image *image.Image
	// QEMU is the emulator binary; default qemu-system-x86_64 from PATH.
	QEMU string
	// Accel is "kvm" (default) or "tcg". TCG is never chosen silently.
	Accel string
	// ColdBoot boots every box from scratch instead of restoring a clone
	// of a template. Slower; for measuring and debugging.
	ColdBoot bool
	// StateDir keeps templates (RAM file, device state, hello) across
	// runs; default os.UserCacheDir()/kiln/microvm.
	StateDir string
	// RunDir holds per-VM files (console logs); default
	// os.TempDir()/kiln-microvm-<pid>.<start>, removed by Close.
	RunDir string
	// Cgroup names the cgroup under which each VM's QEMU gets its own;
	// default "kiln-microvm". NoCgroup runs QEMU without one (non-root).
	Cgroup   string
	NoCgroup bool
	// NoNamespaces runs QEMU unjailed, in the host's namespaces, as the
	// calling user (non-root). Otherwise QEMU runs jailed: a host uid of
	// its own in new user, mount, pid, net, ipc and uts namespaces, with
	// no capabilities, in a root holding only what it needs.
	NoNamespaces bool
	// NoSeccomp leaves out QEMU's -sandbox filter.
	NoSeccomp bool
	// TemplateMaxClones and TemplateMaxAge bound how many clones one
	// template serves and for how long before a fresh one, booted in the
	// background, replaces it (clones of one template share its memory
	// layout and python's hash seed; see rotate_linux.go). 0:
	// DefaultTemplateMaxClones, DefaultTemplateMaxAge; negative: no bound.
	TemplateMaxClones int
	TemplateMaxAge    time.Duration
	// Template is a configured template's files (kiln template), given
	// to every VM read-only at boxpolicy.TemplateDir (template_linux.go).
	Template string
	// Egress, when set with a non-empty Policy, gives every VM a network
	// device on a tap wired to the gateway (egress.Gateway.AttachVM):
	// each box its own attachment, its guest its own address. Without
	// them a VM has no network device at all.
	Egress *egress.Gateway
	Policy egress.Policy
	// BootTimeout bounds booting a template (or a cold box) to its hello;
	// default 60s under KVM, 5m under TCG.
	BootTimeout time.Duration
	// Verbose keeps the guest kernel's messages, runs the agent with -v
	// and keeps RunDir/<id>/console.log after the VM is gone.
	Verbose bool
	Logger  *slog.Logger
}

// Bounds of one template (Options.TemplateMaxClones, TemplateMaxAge).
const (
	DefaultTemplateMaxClones = 500
	DefaultTemplateMaxAge    = 10 * time.Minute
)

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return "microvm" }

// Accel reports the accelerator in use: "kvm" or "tcg".
func (b *Backend) Accel() string { return b.opts.Accel }

// Notes are warnings for kiln doctor and the logs about how this backend
// runs here (software emulation, missing cgroups).
func (b *Backend) Notes() []string { return b.notes }

// Runtime implements sandbox.Describer.
func (b *Backend) Runtime() sandbox.Runtime {
	return sandbox.Runtime{Python: b.opts.Image.Python, Libraries: b.opts.Image.Libraries}
}

var (
	_ sandbox.Backend   = (*Backend)(nil)
	_ sandbox.Checker   = (*Backend)(nil)
	_ sandbox.Describer = (*Backend)(nil)
	_ sandbox.Warmer    = (*Backend)(nil)
	_ sandbox.Noter     = (*Backend)(nil)
)

// moduleName is what a preloaded module name may look like: it goes on the
// guest kernel's command line.
var moduleName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$`)

// cleanPreload drops module names that are not plain dotted identifiers.
func cleanPreload(mods []string) []string {
	var out []string
	for _, m := range mods {
		if moduleName.MatchString(m) && len(m) < 100 {
			out = append(out, m)
		}
	}
	return out
}
