// Package jail is kiln's embedded default backend: each box is a process
// tree in fresh user, mount, pid, network, ipc, uts and cgroup namespaces,
// with a read-only view of the host's runtime, size-capped tmpfs workspace
// and /tmp, only loopback networking, an unprivileged user with no
// capabilities and no_new_privs, Landlock, a seccomp filter, rlimits and
// cgroup limits (v1 or v2). Its first process is kiln-agent.
package jail

import (
	"log/slog"

	"os"
	"os/exec"
	"path/filepath"
	"time"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
)

// Options configure the backend. Zero values mean defaults.
type Options struct {
	// Agent is the path of the kiln-agent binary. Default: next to the
	// running executable, then $PATH.
	Agent string
	// Self is the binary re-executed as the box init (it must call
	// MaybeInit first thing). Default: the running executable.
	Self string
	// Python is the interpreter inside the box. Default /usr/bin/python3.
	Python string
	// StateDir holds per-box mount points. Default: boxkit.StateDir's
	// "kiln-jail" (root's os.TempDir()/kiln-jail; a user's own otherwise;
	// in a pid namespace not the host's, one of that namespace's own).
	StateDir string
	// Env is added to every box's environment.
	Env []string
	// Egress, when set with a non-empty Policy, gives every box a veth to
	// the egress gateway: the box reaches only the allowed hosts, through
	// the gateway's DNS and proxy. Nil or an empty policy: loopback only.
	Egress *egress.Gateway
	Policy egress.Policy
	// Zygote forks boxes from a template python that has imported the
	// preloaded modules, instead of starting python in each (Linux, root,
	// cgroups; not yet with Egress).
	Zygote bool
	// ZygoteMaxBoxes and ZygoteMaxAge bound how many boxes one template
	// serves and for how long before a fresh one, started in the
	// background, replaces it (boxes of one template share its addresses
	// and secrets). 0: DefaultZygoteMaxBoxes, DefaultZygoteMaxAge;
	// negative: no bound.
	ZygoteMaxBoxes int
	ZygoteMaxAge   time.Duration
	// AllBoxes limits this server's boxes together (memory and pids): a
	// cgroup holds every box's group. Zero fields mean no such limit.
	AllBoxes sandbox.Limits
	// Template is a host directory (a configured template's files, kiln
	// template create) bound read-only at boxpolicy.TemplateDir in every box
	// and in the zygote template, so that the zygote can import from it
	// before it forks. Its python directory is on PYTHONPATH.
	// TemplateWritable binds it writable instead, for the template's own
	// setup only; the zygote is then off.
	Template         string
	TemplateWritable bool
	Logger           *slog.Logger
}

// Bounds of one zygote template (Options.ZygoteMaxBoxes, ZygoteMaxAge).
const (
	DefaultZygoteMaxBoxes = 500
	DefaultZygoteMaxAge   = 10 * time.Minute
)

// FindAgent looks for kiln-agent next to the running executable, then in
// $PATH.
func FindAgent() (string, error) {
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), "kiln-agent")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return exec.LookPath("kiln-agent")
}

// ServerCgroupParent holds one cgroup per kiln server
// (<parent>/<server pid>) around its boxes' groups; a dead server's is
// swept by the next. kiln bench counts a jail server's CPU there.
const ServerCgroupParent = "kiln"
