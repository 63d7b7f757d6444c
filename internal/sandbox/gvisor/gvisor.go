// Package gvisor is kiln's gVisor backend: every box is a runsc sandbox
// whose only process is kiln-agent, speaking the agent protocol on its stdin
// and stdout (pipes). gVisor's user-space kernel sits between the model's
// code and the host kernel.
//
// A box's root is a read-only view of the host runtime (/usr and friends,
// plus a synthesized /etc) or an image root directory; its workspace and
// /tmp are size-capped tmpfs inside the sandbox; it has no network unless
// the backend has an egress policy (then only through the egress gateway,
// egress_linux.go) and no new privileges, and its memory, CPU and host pids are bounded by the
// cgroup runsc creates from the OCI spec. Code runs as nobody with no
// capabilities; the agent runs as root of the box with the few it needs
// (agentCaps), so code cannot signal it or reopen its stream through /proc.
// HOME and the caches are under the box's /tmp, outside the workspace.
//
// Boxes die with the kiln process (runsc gets Pdeathsig, and passes one on
// to the sandbox and gofer); the cgroups of a dead kiln are named after it
// and removed by the next backend to start.
//
// Warm start: for each distinct box shape (limits that shape the filesystem,
// preloaded modules) the backend checkpoints one template box whose kernel
// has imported its libraries, and restores later boxes from that image.
package gvisor

import (
	"log/slog"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
)

// Options configure the backend. The zero value of each field is its default.
type Options struct {
	// Agent is the static kiln-agent binary, bound read-only into every box.
	// Required.
	Agent string
	// Runsc is a static runsc binary. Empty: the pinned runsc from kiln's
	// cache, built by EnsureRunsc (which can take a minute the first time).
	Runsc string
	// Rootfs is an image root directory (from kiln image build) to use as
	// every box's read-only root. It must hold /work, /tmp, /proc, /dev,
	// /sys and the file /.kiln/kiln-agent (a mount point). Empty: a
	// read-only view of the host runtime.
	Rootfs string
	// StateDir holds bundles, runsc state and checkpoint images, in a
	// subdirectory per kiln process. Default: /run/kiln-gvisor, or
	// <temp dir>/kiln-gvisor when /run is not writable.
	StateDir string
	// Platform is runsc's platform. Default "systrap"; "ptrace" works
	// everywhere but costs about 12× per syscall; "kvm" needs /dev/kvm.
	Platform string
	// UID and GID code runs as in the box. Default 65534 (nobody). Root
	// (0) is refused; it is the agent's.
	UID, GID uint32
	// Cold disables warm start: every box boots and imports its libraries
	// itself instead of being restored from a checkpoint.
	Cold bool
	// Debug keeps runsc's debug logs in each box's state directory (they go
	// away with the box).
	Debug bool
	// Template is a host directory (a configured template's files, kiln
	// template create) bound read-only at boxpolicy.TemplateDir in every box
	// and in the warm-start template before its checkpoint, with its
	// python directory on PYTHONPATH (template.go).
	Template string
	// TemplateWritable binds Template writable instead, for the
	// template's own setup (and disables warm start).
	TemplateWritable bool
	// Egress, when set with a non-empty Policy, wires every box to the
	// egress gateway: each gets a network namespace of its own, made and
	// attached by the gateway (egress.Gateway.AttachNetNS), which runsc
	// --network=sandbox turns into the box's netstack interface, plus the
	// gateway's resolv.conf, proxy environment and, with secrets, its CA.
	// The box reaches only the allowed hosts, through the gateway. Nil or
	// an empty policy: loopback only (runsc --network=none).
	Egress *egress.Gateway
	Policy egress.Policy
	// Logger receives lifecycle events. Default: discard.
	Logger *slog.Logger
}

// Info describes the runsc a backend uses, for kiln doctor.
type Info struct {
	Runsc    string // path
	Version  string // as runsc reports it
	Platform string
	Rootfs   string // "" for the host runtime view
	StateDir string
	Warm     bool
}

var (
	_ sandbox.Backend   = (*Backend)(nil)
	_ sandbox.Checker   = (*Backend)(nil)
	_ sandbox.Describer = (*Backend)(nil)
	_ sandbox.Warmer    = (*Backend)(nil)
)

// Name is the --backend value.
func (b *Backend) Name() string { return "gvisor" }

// DefaultPlatform is runsc's platform when Options says none.
const DefaultPlatform = "systrap"

func (o Options) withDefaults() Options {
	if o.Platform == "" {
		o.Platform = DefaultPlatform
	}
	if o.UID == 0 {
		o.UID = 65534
	}
	if o.GID == 0 {
		o.GID = 65534
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// CgroupParent holds the cgroups runsc creates for kiln's boxes, one per
// box, named <owner>.<container ID> where owner is the kiln process's stamp
// (pid and start time, boxkit.Owner), so that any kiln can tell which ones
// a dead process left; kiln bench counts the CPU under it.
const CgroupParent = "/kiln-gvisor"
