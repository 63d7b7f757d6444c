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
	"time"

	"kiln/internal/agentproto"
)

// Sentinel errors shared by every backend.
var (
	ErrClosed      = errors.New("sandbox: closed")
	ErrUnsupported = errors.New("sandbox: not supported on this host")
	ErrDied        = errors.New("sandbox: the box died")
)

// Backend creates boxes.
type Backend interface {
	// Name is the --backend value that selects it ("jail", "gvisor", …).
	Name() string
	// Create starts a box and returns once its agent is ready for calls.
	Create(ctx context.Context, spec Spec) (Sandbox, error)
}

// Checker is implemented by backends that can tell whether they work on this
// host (kiln doctor).
type Checker interface {
	Check(ctx context.Context) error
}

// Describer is implemented by backends that can describe the runtime inside
// their boxes for tool descriptions (python version, libraries).
type Describer interface {
	Runtime() Runtime
}

// RefusalReporter is implemented by boxes behind an egress policy: the
// connections it refused since the last call, in words for the model.
type RefusalReporter interface {
	NetworkRefusals() []string
}

// Runtime is what code inside a box can use.
type Runtime struct {
	Python    string   // "3.11.2"; empty if there is no python
	Libraries []string // notable importable libraries
}

// Spec is what a new box must enforce.
type Spec struct {
	ID     string // unique, safe for file names; the backend may use it in paths
	Limits Limits
	// Preload lists Python modules the kernel imports before the box is
	// handed out, so the first call does not pay for them. Missing modules
	// are skipped.
	Preload []string
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
	MaxOutput int // bytes kept per stream (head and tail)
}
