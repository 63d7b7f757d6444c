// Package sessiontest holds what tests of the session layer and above
// share: an in-process backend, and the per-call conformance cases every
// real backend runs (RunPerCall).
//
// The backend runs each box's kiln agent inside the test process, on
// in-memory pipes, with a temporary directory as its workspace. It
// isolates nothing: it exists so that the session and MCP layers (quotas,
// the box cap, timeouts, box death, teardown of stuck boxes, rendering)
// can be tested without root, through the real agent, the real python
// kernel and the real host-side client. Code runs on the host as the
// test's user; keep it harmless.
package sessiontest

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"

	"kiln/internal/agent"
	"kiln/internal/sandbox"
)

// Options tune a Backend; nil means defaults.
type Options struct {
	// Python is the python3 the boxes' kernels run; "" gives boxes
	// without python (shell and files only), which start faster.
	Python string
}

// Backend makes in-process boxes and counts them.
type Backend struct {
	dir    string
	python string
	stuck  atomic.Int64 // agent reads and writes held by a frozen gate
	// oomKills and pidsRefused are what every box reports as its limit
	// counters (sandbox.LimitReporter); HitLimits raises them.
	oomKills, pidsRefused atomic.Int64
	limitReads            atomic.Int64 // LimitHits calls, each a round trip on some backends
	sent                  atomic.Int64 // bytes the agents wrote to the host

	mu      sync.Mutex
	live    int // created and not yet fully destroyed
	peak    int
	created int
	closed  bool
	boxes   map[*box]struct{}
}

var _ sandbox.Backend = (*Backend)(nil)

// New returns a backend whose workspaces live under the test's temporary
// directory. Its boxes are destroyed when the test ends, if not before.
func New(t testing.TB, opts *Options) *Backend {
	var o Options
	if opts != nil {
		o = *opts
	}
	b := &Backend{dir: t.TempDir(), python: o.Python, boxes: map[*box]struct{}{}}
	t.Cleanup(func() { b.Close() })
	return b
}

// Python returns a python3 with the libraries kiln's boxes preload
// (numpy, pandas, matplotlib), or skips the test. The system's python3 is
// preferred over whatever comes first on PATH.
func Python(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"/usr/bin/python3", "python3"} {
		path, err := exec.LookPath(p)
		if err != nil {
			continue
		}
		if exec.Command(path, "-c", "import numpy, pandas, matplotlib").Run() == nil {
			return path
		}
	}
	t.Skip("needs a python3 with numpy, pandas and matplotlib")
	return ""
}

func (b *Backend) Name() string { return "inprocess" }

// Live is the number of boxes created and not yet fully destroyed.
func (b *Backend) Live() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.live
}

// Peak is the largest Live has been.
func (b *Backend) Peak() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.peak
}

// Created counts the boxes ever created.
func (b *Backend) Created() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.created
}

// Stuck is how many times an agent's read or write is being held by Freeze
// right now: a call reached the stopped agent.
func (b *Backend) Stuck() int { return int(b.stuck.Load()) }

// Sent is the bytes every box's agent has written to the host so far:
// what the host pulled out of its boxes (a snapshot's archive included).
func (b *Backend) Sent() int64 { return b.sent.Load() }

// Freeze stops the agent of every live box, as SIGSTOP would: it reads no
// request and answers none until the box is destroyed.
func (b *Backend) Freeze() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for bx := range b.boxes {
		bx.gate.freeze()
	}
}

// Kill makes every live box die, as the kernel's OOM killer would: its
// agent stops and its stream ends, without a word from the host.
func (b *Backend) Kill() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for bx := range b.boxes {
		bx.gate.kill()
		bx.ar.CloseWithError(io.ErrClosedPipe)
		bx.aw.CloseWithError(io.ErrClosedPipe)
	}
}

// Close destroys every live box and refuses new ones.
func (b *Backend) Close() error {
	b.mu.Lock()
	b.closed = true
	var destroy []func() error
	for bx := range b.boxes {
		destroy = append(destroy, bx.destroy)
	}
	b.mu.Unlock()
	var errs []error
	for _, d := range destroy {
		errs = append(errs, d())
	}
	return errors.Join(errs...)
}

// Create starts an agent, with a python kernel if the backend has python.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	ws, err := os.MkdirTemp(b.dir, "box-")
	if err != nil {
		return nil, err
	}
	hr, aw := io.Pipe() // agent → host
	ar, hw := io.Pipe() // host → agent
	bx := &box{gate: &gate{dead: make(chan struct{}), stuck: &b.stuck}, served: make(chan struct{}), ar: ar, aw: aw}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		os.RemoveAll(ws)
		return nil, sandbox.ErrClosed
	}
	a := agent.New(agent.Config{Workspace: ws, Python: b.python, Preload: spec.Preload, UID: -1, GID: -1})
	go func() {
		defer close(bx.served)
		a.Serve(gatedReader{ar, bx.gate}, gatedWriter{aw, bx.gate, &b.sent})
	}()
	b.live++
	b.created++
	b.peak = max(b.peak, b.live)
	b.boxes[bx] = struct{}{}
	var once sync.Once
	bx.destroy = func() error {
		once.Do(func() {
			bx.gate.kill()
			hw.Close()
			ar.Close()
			aw.Close()
			<-bx.served
			os.RemoveAll(ws)
			b.mu.Lock()
			b.live--
			delete(b.boxes, bx)
			b.mu.Unlock()
		})
		return nil
	}
	b.mu.Unlock()
	conn, err := sandbox.NewAgentConn(ctx, spec.ID, pipeStream{hr, hw}, bx.destroy)
	if err != nil {
		return nil, errors.Join(err, bx.destroy())
	}
	return &countingConn{conn, b}, nil
}

// HitLimits raises the limit counters every box reports, as a backend's
// cgroup would count an OOM kill or a fork refused at the pids limit. The
// in-process boxes enforce no limit: a test says when one was hit.
func (b *Backend) HitLimits(oomKills, pidsRefused int64) {
	b.oomKills.Add(oomKills)
	b.pidsRefused.Add(pidsRefused)
}

// countingConn is a box's connection with the backend's limit counters.
type countingConn struct {
	*sandbox.AgentConn
	b *Backend
}

var (
	_ sandbox.LimitReporter = (*countingConn)(nil)
	// State-level snapshots work here too, through the real agent (the
	// host's python3 needs dill).
	_ sandbox.Snapshotter = (*countingConn)(nil)
	_ sandbox.StateLoader = (*countingConn)(nil)
)

// LimitReads is how many times the boxes' limit counters were read.
func (b *Backend) LimitReads() int64 { return b.limitReads.Load() }

func (c *countingConn) LimitHits() sandbox.LimitHits {
	c.b.limitReads.Add(1)
	return sandbox.LimitHits{OOMKills: c.b.oomKills.Load(), PidsRefused: c.b.pidsRefused.Load()}
}

type box struct {
	gate    *gate
	served  chan struct{}
	ar      *io.PipeReader // the agent's ends of its stream
	aw      *io.PipeWriter
	destroy func() error
}

// gate blocks the agent's reads and writes while frozen, until killed.
type gate struct {
	mu     sync.Mutex
	frozen chan struct{} // non-nil while frozen; closed on kill
	dead   chan struct{}
	once   sync.Once
	stuck  *atomic.Int64
}

func (g *gate) freeze() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.frozen == nil {
		g.frozen = make(chan struct{})
	}
}

func (g *gate) kill() { g.once.Do(func() { close(g.dead) }) }

// pass blocks while frozen; it fails once the box is killed.
func (g *gate) pass() error {
	g.mu.Lock()
	frozen := g.frozen
	g.mu.Unlock()
	if frozen != nil {
		g.stuck.Add(1)
		<-g.dead
		g.stuck.Add(-1)
	}
	select {
	case <-g.dead:
		return io.ErrClosedPipe
	default:
		return nil
	}
}

type gatedReader struct {
	r io.Reader
	g *gate
}

func (r gatedReader) Read(p []byte) (int, error) {
	if err := r.g.pass(); err != nil {
		return 0, err
	}
	n, err := r.r.Read(p)
	if err == nil {
		err = r.g.pass() // frozen while it waited: the request is never seen
		if err != nil {
			n = 0
		}
	}
	return n, err
}

type gatedWriter struct {
	w    io.Writer
	g    *gate
	sent *atomic.Int64
}

func (w gatedWriter) Write(p []byte) (int, error) {
	if err := w.g.pass(); err != nil {
		return 0, err
	}
	n, err := w.w.Write(p)
	w.sent.Add(int64(n))
	return n, err
}

type pipeStream struct {
	*io.PipeReader
	*io.PipeWriter
}

func (s pipeStream) Close() error {
	return errors.Join(s.PipeReader.Close(), s.PipeWriter.Close())
}
