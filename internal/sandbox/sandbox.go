// Package sandbox is the contract between kiln's session layer and its
// isolation backends.
//
// A backend's job is only to start an isolated box whose first process is
// kiln-agent, hand back a byte stream to it, enforce the box's limits and
// destroy it. Exec, files, kernels and rich output live once, in the agent
// and in AgentConn, the host-side client of its protocol. A backend that
// cannot host the agent (WASM) implements Sandbox itself and passes the same
// conformance suite (package sandboxtest).
package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/boxpolicy"
)

// Sentinel errors shared by every backend.
var (
	ErrClosed      = errors.New("sandbox: closed")
	ErrUnsupported = errors.New("sandbox: not supported on this host")
	ErrDied        = errors.New("sandbox: the box died")
)

// Backend creates boxes. Close releases what the backend holds (templates,
// zygotes, cgroups, state directories) and, where the backend tracks them,
// destroys its live boxes; servers call it last, after closing every box. A
// backend with nothing of its own returns nil.
//
// What a backend can do beyond this is a named interface below, found by a
// type assertion; each backend asserts at compile time which ones it
// satisfies.
type Backend interface {
	// Name is the --backend value that selects it ("jail", "gvisor", …).
	Name() string
	// Create starts a box and returns once its agent is ready for calls.
	Create(ctx context.Context, spec Spec) (Sandbox, error)
	io.Closer
}

// Checker is implemented by backends that can tell whether they work on this
// host (kiln doctor). Check proves a box runs: it starts one, runs a trivial
// call in it (see Probe) and destroys it; checking files and binaries alone
// is not enough.
type Checker interface {
	Check(ctx context.Context) error
}

// Warmer is implemented by backends that build something ahead of demand
// (a template box, a snapshot) so that the first Create does not pay for
// it. Servers call Warm at start with the spec of the boxes they will ask
// for; Create builds it lazily otherwise.
type Warmer interface {
	Warm(ctx context.Context, spec Spec) error
}

// Describer is implemented by backends that can describe the runtime inside
// their boxes for tool descriptions (python version, libraries).
type Describer interface {
	Runtime() Runtime
}

// OOMReporter is implemented by boxes that can tell whether their memory
// limit killed something in them.
type OOMReporter interface {
	OOMKilled() bool
}

// LimitReporter is implemented by boxes whose host counts how often their
// limits stopped something in them (cgroup memory and pids events). The
// session layer compares the counts before and after a call to name the
// limit a call hit; OOMReporter alone cannot tell which call it was.
type LimitReporter interface {
	LimitHits() LimitHits
}

// LimitHits counts what a box's limits stopped since the box started. A
// count the host cannot see is -1.
type LimitHits struct {
	OOMKills    int64 // processes killed for going over the memory limit
	PidsRefused int64 // forks and clones refused at the pids limit
}

// RefusalReporter is implemented by boxes behind an egress policy: the
// connections it refused since the last call, in words for the model.
type RefusalReporter interface {
	NetworkRefusals() []string
}

// HostLossReporter is implemented by boxes that run on another host (a
// kiln node) and can tell, once they are done, whether that host went
// with them, rather than the box dying on it. HostLost says how, in words
// for the model ("the kiln node at 10.0.0.5:7070 that ran the sandbox was
// lost (…)"), and "" when the host is still there or the box is not done.
// The session layer resumes a session whose host was lost from its last
// checkpoint, where one whose box died of itself starts afresh.
type HostLossReporter interface {
	HostLost() string
}

// Noter is implemented by backends that work here with caveats (software
// emulation, no cgroups): notes for kiln doctor and the logs.
type Noter interface {
	Notes() []string
}

// Probe proves that box runs code: a trivial shell call must print "ok".
// Checkers call it on the box they start.
func Probe(ctx context.Context, box Sandbox) error {
	res, err := box.RunShell(ctx, "echo ok", ExecOptions{MaxOutput: 1024})
	if err != nil {
		return fmt.Errorf("running a command in a box: %w", err)
	}
	if strings.TrimSpace(res.Stdout.Text) != "ok" {
		return fmt.Errorf("running a command in a box: got %q (exit %d, stderr %q)", res.Stdout.Text, res.ExitCode, res.Stderr.Text)
	}
	return nil
}

// Runtime is what code inside a box can use.
type Runtime struct {
	Python    string   // "3.11.2"; empty if there is no python
	Libraries []string // notable importable libraries
	// NoShell, when set, says why boxes have no shell (wasm): servers then
	// do not offer run_shell, and their tool descriptions say why.
	NoShell string
	// Notes are what else the model should know of the runtime, one
	// sentence each ("only the standard library").
	Notes []string
}

// DefaultPreload is what kiln's servers preload when the configuration
// says nothing (--preload): one list, so that a test of the default
// template tests what users get.
var DefaultPreload = []string{"numpy", "pandas", "matplotlib"}

// Spec is what a new box must enforce.
type Spec struct {
	ID     string // unique, safe for file names; the backend may use it in paths
	Limits Limits
	// Preload lists Python modules the kernel imports before the box is
	// handed out, so the first call does not pay for them. Missing modules
	// are skipped.
	Preload []string
	// Urgent says a call is waiting for this box (not a pool filling
	// ahead of demand). A backend whose template for the spec is still
	// being built may then start a plain box without the preloads rather
	// than make the call wait for the template: the call pays only for
	// the imports it uses.
	Urgent bool
}

// Limits bound what one box may consume. Zero values mean the defaults.
type Limits struct {
	MemoryBytes    int64   // RAM (and tmpfs pages, which are charged to it)
	Pids           int     // processes and threads
	CPUs           float64 // CPU bandwidth, in cores
	WorkspaceBytes int64   // size of the writable workspace
	TmpBytes       int64   // size of /tmp
	Inodes         int     // files in the workspace and in /tmp, each
	OpenFiles      int     // RLIMIT_NOFILE
}

// DefaultLimits are the limits of a box when the configuration says nothing.
var DefaultLimits = Limits{
	MemoryBytes:    1 << 30,
	Pids:           256,
	CPUs:           1,
	WorkspaceBytes: 512 << 20,
	TmpBytes:       256 << 20,
	Inodes:         65536,
	OpenFiles:      1024,
}

// Plan is the box plan (boxpolicy.New) of a box with limits l whose
// workspace belongs to uid and gid (-1: to whoever mounts it): what each
// backend builds its boxes from.
func (l Limits) Plan(uid, gid int) boxpolicy.Plan {
	return boxpolicy.New(boxpolicy.Limits{
		WorkspaceBytes: l.WorkspaceBytes,
		TmpBytes:       l.TmpBytes,
		Inodes:         l.Inodes,
		Pids:           l.Pids,
		OpenFiles:      l.OpenFiles,
	}, uid, gid)
}

// WithDefaults fills zero fields from DefaultLimits.
func (l Limits) WithDefaults() Limits {
	d := DefaultLimits
	if l.MemoryBytes == 0 {
		l.MemoryBytes = d.MemoryBytes
	}
	if l.Pids == 0 {
		l.Pids = d.Pids
	}
	if l.CPUs == 0 {
		l.CPUs = d.CPUs
	}
	if l.WorkspaceBytes == 0 {
		l.WorkspaceBytes = d.WorkspaceBytes
	}
	if l.TmpBytes == 0 {
		l.TmpBytes = d.TmpBytes
	}
	if l.Inodes == 0 {
		l.Inodes = d.Inodes
	}
	if l.OpenFiles == 0 {
		l.OpenFiles = d.OpenFiles
	}
	return l
}

// Within returns l with every field held to ceil's: a field that is zero
// or above ceil's takes ceil's. A host that makes boxes for another (a kiln
// node for its front) holds what it is asked for within its own limits.
func (l Limits) Within(ceil Limits) Limits {
	ceil = ceil.WithDefaults()
	hold := func(v, c int64) int64 {
		if v <= 0 || v > c {
			return c
		}
		return v
	}
	l.MemoryBytes = hold(l.MemoryBytes, ceil.MemoryBytes)
	l.Pids = int(hold(int64(l.Pids), int64(ceil.Pids)))
	if !(l.CPUs > 0 && l.CPUs <= ceil.CPUs) { // NaN too
		l.CPUs = ceil.CPUs
	}
	l.WorkspaceBytes = hold(l.WorkspaceBytes, ceil.WorkspaceBytes)
	l.TmpBytes = hold(l.TmpBytes, ceil.TmpBytes)
	l.Inodes = int(hold(int64(l.Inodes), int64(ceil.Inodes)))
	l.OpenFiles = int(hold(int64(l.OpenFiles), int64(ceil.OpenFiles)))
	return l
}

// Sandbox is one live box. Its methods may be called concurrently; Interrupt
// and Close unblock a running call.
type Sandbox interface {
	ID() string
	// RunPython runs a cell in the box's persistent kernel.
	RunPython(ctx context.Context, code string, opts ExecOptions) (*agentproto.ExecResult, error)
	// RunShell runs a bash command in the workspace.
	RunShell(ctx context.Context, command string, opts ExecOptions) (*agentproto.ExecResult, error)
	// Interrupt asks whatever is running to stop (KeyboardInterrupt, SIGINT).
	Interrupt(ctx context.Context) error
	WriteFile(ctx context.Context, path string, data []byte) error
	// ReadFile returns at most max bytes of the file and its full size.
	ReadFile(ctx context.Context, path string, max int64) (data []byte, size int64, err error)
	ListFiles(ctx context.Context, path string) ([]agentproto.FileInfo, error)
	// Changes lists regular files under the workspace modified at or after since.
	Changes(ctx context.Context, since time.Time) ([]agentproto.FileInfo, error)
	// Done is closed when the box has died or been closed.
	Done() <-chan struct{}
	// Close destroys the box and everything in it. It is safe to call twice.
	Close() error
}

// ExecOptions tune one call.
type ExecOptions struct {
	MaxOutput int // bytes kept per stream (head and tail); 0: agentproto.DefaultMaxOutput
}
