package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"kiln/internal/agentproto"
)

// Errors of a box that broke its agent's protocol. Either way the box is
// destroyed: what comes out of a box is hostile input, and a box whose
// agent misbehaves once cannot be trusted with the next call.
var (
	// ErrBroken is a frame from the box that failed validation (a cut
	// outside its text, a response to no pending request, a frame that is
	// not JSON, …), or a fault of kiln while handling one.
	ErrBroken = errors.New("sandbox: the box broke the agent protocol and was destroyed")
	// ErrUnresponsive is an agent that did not answer a request within
	// its deadline (a stopped agent, a stream nobody reads).
	ErrUnresponsive = errors.New("sandbox: the agent stopped answering and the box was destroyed")
)

// maxHello bounds the agent's first frame: a version, a few module names,
// or why it could not start.
const maxHello = 1 << 20

// DefaultRequestTimeout bounds every request but exec (whose time limit the
// session enforces): file operations, listings, interrupts. An honest
// agent listing a 600-deep tree on a loaded host took 20 s; a stopped one
// never answers.
const DefaultRequestTimeout = 2 * time.Minute

// AgentConnOptions tune an AgentConn; nil means defaults.
type AgentConnOptions struct {
	// RequestTimeout is the server-side deadline of every request but
	// exec. When it passes, the call fails and the box is destroyed.
	RequestTimeout time.Duration
	Logger         *slog.Logger
	// Backend names the backend in the manifests of the box's snapshots.
	Backend string
}

// AgentConn is the host-side client of kiln-agent's protocol. Backends that
// host the agent wrap their byte stream in one and get the whole Sandbox
// interface; they supply only how to destroy the box.
//
// Every frame from the box is validated before anyone uses it (Hello.Check,
// Response.Check): a frame that fails is a fault of the box, which fails
// the calls in flight with ErrBroken and destroys the box. So does a panic
// while handling a frame.
type AgentConn struct {
	id      string
	stream  io.ReadWriteCloser
	destroy func() error
	hello   agentproto.Hello
	backend string
	timeout time.Duration
	log     *slog.Logger

	wsem    chan struct{} // serializes frames on the stream; a waiter can give up
	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]*pendingCall // nil once the stream is done
	done    chan struct{}
	deadErr error // why the stream is done: ErrDied or a fault

	closeOnce sync.Once
	closeErr  error
}

// pendingCall is a request waiting for its answer. ch is nil once its
// caller gave up: a late answer is then accepted and dropped. live gets
// the Output frames of an exec request that asked for them.
type pendingCall struct {
	req  agentproto.Request
	ch   chan *agentproto.Response
	live OutputFunc
}

// OutputFunc receives the newest output of a running RunPython or RunShell
// call, as the agent reports it: at most one report per
// agentproto.LiveInterval, its tail within agentproto.MaxLiveTail, all of
// it validated. It is called on the connection's reader and must not
// block: keep the newest report and return.
type OutputFunc func(agentproto.Output)

type outputKey struct{}

// WithOutput returns a context under which RunPython and RunShell ask the
// agent for the live output of the call and pass it to f. A context on
// which it was not called asks for none, which is the default.
func WithOutput(ctx context.Context, f OutputFunc) context.Context {
	return context.WithValue(ctx, outputKey{}, f)
}

func outputOf(ctx context.Context) OutputFunc {
	f, _ := ctx.Value(outputKey{}).(OutputFunc)
	return f
}

var _ Sandbox = (*AgentConn)(nil)

// NewAgentConn waits for the agent's hello on stream and returns the client.
// destroy tears the box down; it is called once, by Close, after the stream
// is closed. If ctx ends before the hello, the box is destroyed.
func NewAgentConn(ctx context.Context, id string, stream io.ReadWriteCloser, destroy func() error) (*AgentConn, error) {
	return DialAgent(ctx, id, stream, destroy, nil)
}

// DialAgent is NewAgentConn with options.
func DialAgent(ctx context.Context, id string, stream io.ReadWriteCloser, destroy func() error, opts *AgentConnOptions) (*AgentConn, error) {
	var o AgentConnOptions
	if opts != nil {
		o = *opts
	}
	if o.RequestTimeout <= 0 {
		o.RequestTimeout = DefaultRequestTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	c := &AgentConn{
		id:      id,
		stream:  stream,
		destroy: destroy,
		backend: o.Backend,
		timeout: o.RequestTimeout,
		log:     o.Logger.With("box", id),
		pending: make(map[uint64]*pendingCall),
		done:    make(chan struct{}),
		wsem:    make(chan struct{}, 1),
	}
	helloc := make(chan error, 1)
	go func() {
		defer func() {
			if v := recover(); v != nil {
				helloc <- c.panicked(v)
			}
		}()
		err := agentproto.ReadFrameMax(stream, &c.hello, func() int { return maxHello })
		if err == nil {
			err = c.hello.Check()
		}
		if err == nil && c.hello.Error != "" {
			err = errors.New(c.hello.Error)
		}
		helloc <- err
	}()
	select {
	case err := <-helloc:
		if err != nil {
			c.Close()
			if agentproto.IsFault(err) {
				err = fmt.Errorf("%w: %w", ErrBroken, err)
			}
			return nil, fmt.Errorf("waiting for agent: %w", err)
		}
	case <-ctx.Done():
		c.Close()
		<-helloc
		return nil, fmt.Errorf("waiting for agent: %w", ctx.Err())
	}
	go c.readLoop()
	return c, nil
}

// Hello returns what the agent said when it started.
func (c *AgentConn) Hello() agentproto.Hello { return c.hello }

func (c *AgentConn) ID() string { return c.id }

func (c *AgentConn) Done() <-chan struct{} { return c.done }

// Err says why the connection is done once Done is closed (ErrDied, or a
// fault wrapping ErrBroken or ErrUnresponsive); nil before.
func (c *AgentConn) Err() error {
	select {
	case <-c.done:
		return c.err()
	default:
		return nil
	}
}

// panicked turns a panic while handling the box's frames into a fault.
func (c *AgentConn) panicked(v any) error {
	c.log.Error("panic handling a frame from the box", "panic", v, "stack", string(debug.Stack()))
	return fmt.Errorf("%w: kiln faulted handling its frame: %v", ErrBroken, v)
}

func (c *AgentConn) readLoop() {
	var err error
	defer func() {
		if v := recover(); v != nil {
			err = c.panicked(v)
		}
		c.fail(err)
	}()
	for {
		resp := new(agentproto.Response)
		if err = agentproto.ReadFrameMax(c.stream, resp, c.answerMax); err != nil {
			if agentproto.IsFault(err) {
				err = fmt.Errorf("%w: %w", ErrBroken, err)
			} else {
				err = ErrDied
			}
			return
		}
		if resp.Output != nil {
			if err = c.output(resp); err != nil {
				return
			}
			continue
		}
		c.mu.Lock()
		p, ok := c.pending[resp.ID]
		delete(c.pending, resp.ID)
		var ch chan *agentproto.Response
		if ok {
			ch = p.ch
		}
		c.mu.Unlock()
		if !ok {
			err = fmt.Errorf("%w: a response to request %d, which is not pending", ErrBroken, resp.ID)
			return
		}
		if err = resp.Check(&p.req); err != nil {
			err = fmt.Errorf("%w: %w", ErrBroken, err)
			return
		}
		if ch != nil {
			ch <- resp
		}
	}
}

// output hands a progress frame to its running call, which stays pending.
// One for no pending request, or one that fails validation, is a fault.
func (c *AgentConn) output(resp *agentproto.Response) error {
	c.mu.Lock()
	p, ok := c.pending[resp.ID]
	var live OutputFunc
	if ok && p.ch != nil {
		live = p.live
	}
	c.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: output of request %d, which is not pending", ErrBroken, resp.ID)
	}
	if err := resp.Check(&p.req); err != nil {
		return fmt.Errorf("%w: %w", ErrBroken, err)
	}
	if live != nil {
		live(*resp.Output)
	}
	return nil
}

// answerMax is the longest frame that can answer a request in flight
// (or one given up on): a box that sends more is refused before its frame
// is buffered.
func (c *AgentConn) answerMax() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, p := range c.pending {
		n = max(n, p.req.MaxAnswer())
	}
	return n
}

// fail ends the connection for err: calls in flight and later ones get
// it, and the box is destroyed. The first reason wins.
func (c *AgentConn) fail(err error) {
	c.mu.Lock()
	first := c.pending != nil
	if first {
		c.pending = nil
		c.deadErr = err
		close(c.done)
	}
	c.mu.Unlock()
	if first && !errors.Is(err, ErrDied) && !errors.Is(err, ErrClosed) {
		c.log.Warn("destroying a box that broke the agent protocol", "err", err)
	}
	c.Close()
}

// err is why the connection is done.
func (c *AgentConn) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.deadErr == nil {
		return ErrDied
	}
	return c.deadErr
}

// call sends req and waits for its response, the box's death, ctx, or —
// for every operation but exec — the request deadline, after which the box
// is destroyed.
func (c *AgentConn) call(ctx context.Context, req agentproto.Request) (resp *agentproto.Response, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = c.panicked(v)
			c.fail(err)
		}
	}()
	ch := make(chan *agentproto.Response, 1)
	c.mu.Lock()
	if c.pending == nil {
		c.mu.Unlock()
		return nil, c.err()
	}
	c.nextID++
	req.ID = c.nextID
	p := &pendingCall{req: req, ch: ch}
	if req.Live {
		p.live = outputOf(ctx)
	}
	c.pending[req.ID] = p
	c.mu.Unlock()

	if req.Op != agentproto.OpPython && req.Op != agentproto.OpShell {
		// The deadline also covers the write: an agent that stopped
		// reading blocks it, and destroying the box unblocks it.
		timeout := c.timeout
		if req.Op == agentproto.OpSaveState || req.Op == agentproto.OpLoadState {
			timeout = max(timeout, StateTimeout) // pickling scales with the state
		}
		t := time.AfterFunc(timeout, func() {
			c.fail(fmt.Errorf("%w: no answer to a %s request within %s", ErrUnresponsive, req.Op, timeout))
		})
		defer t.Stop()
	}
	select {
	case c.wsem <- struct{}{}:
	case <-c.done:
		return nil, c.err()
	case <-ctx.Done():
		c.forget(req.ID)
		return nil, ctx.Err()
	}
	err = agentproto.WriteFrame(c.stream, &req)
	<-c.wsem
	if err != nil {
		select {
		case <-c.done:
			return nil, c.err()
		default:
		}
		c.forget(req.ID)
		return nil, fmt.Errorf("sending %s request: %w", req.Op, err)
	}
	select {
	case resp := <-ch:
		if resp.Error != "" {
			return resp, &AgentError{Op: req.Op, Msg: resp.Error}
		}
		return resp, nil
	case <-c.done:
		return nil, c.err()
	case <-ctx.Done():
		c.forget(req.ID)
		return nil, ctx.Err()
	}
}

// Forward sends req, a request another host made of this box (a kiln
// node relays its front's requests), as one of this connection's own, and
// returns the box's answer, validated as every answer is. The answer
// carries this connection's request ID; the relay puts its own back. An
// operation the agent refused is an answer (its Error set), not an error:
// the error is the box's death, a fault, or ctx. live gets the request's
// Output frames when req.Live; without live the request asks for none.
func (c *AgentConn) Forward(ctx context.Context, req agentproto.Request, live OutputFunc) (*agentproto.Response, error) {
	req.Live = req.Live && live != nil
	if req.Live {
		ctx = WithOutput(ctx, live)
	}
	resp, err := c.call(ctx, req)
	var ae *AgentError
	if errors.As(err, &ae) && resp != nil {
		return resp, nil
	}
	return resp, err
}

// forget gives up on a request; its answer, if it comes, is dropped.
func (c *AgentConn) forget(id uint64) {
	c.mu.Lock()
	if p := c.pending[id]; p != nil {
		p.ch = nil
	}
	c.mu.Unlock()
}

// AgentError is an operation the agent refused or could not do (a bad path,
// a missing file). Its message is safe to show to the model.
type AgentError struct {
	Op  string
	Msg string
}

func (e *AgentError) Error() string { return e.Msg }

func (c *AgentConn) RunPython(ctx context.Context, code string, opts ExecOptions) (*agentproto.ExecResult, error) {
	return c.exec(ctx, agentproto.OpPython, code, opts)
}

func (c *AgentConn) RunShell(ctx context.Context, command string, opts ExecOptions) (*agentproto.ExecResult, error) {
	return c.exec(ctx, agentproto.OpShell, command, opts)
}

func (c *AgentConn) exec(ctx context.Context, op, code string, opts ExecOptions) (*agentproto.ExecResult, error) {
	resp, err := c.call(ctx, agentproto.Request{Op: op, Code: code, MaxOutput: opts.MaxOutput, Live: outputOf(ctx) != nil})
	if err != nil {
		return nil, err
	}
	if resp.Exec == nil {
		return nil, fmt.Errorf("agent answered %s without a result", op)
	}
	return resp.Exec, nil
}

func (c *AgentConn) Interrupt(ctx context.Context) error {
	_, err := c.call(ctx, agentproto.Request{Op: agentproto.OpInterrupt})
	return err
}

func (c *AgentConn) WriteFile(ctx context.Context, path string, data []byte) error {
	_, err := c.call(ctx, agentproto.Request{Op: agentproto.OpWrite, Path: path, Data: data})
	return err
}

func (c *AgentConn) ReadFile(ctx context.Context, path string, max int64) ([]byte, int64, error) {
	resp, err := c.call(ctx, agentproto.Request{Op: agentproto.OpRead, Path: path, MaxBytes: max})
	if err != nil {
		return nil, 0, err
	}
	return resp.Data, resp.Size, nil
}

func (c *AgentConn) ListFiles(ctx context.Context, path string) ([]agentproto.FileInfo, error) {
	resp, err := c.call(ctx, agentproto.Request{Op: agentproto.OpList, Path: path})
	if err != nil {
		return nil, err
	}
	return resp.Files, nil
}

func (c *AgentConn) Changes(ctx context.Context, since time.Time) ([]agentproto.FileInfo, error) {
	resp, err := c.call(ctx, agentproto.Request{Op: agentproto.OpChanges, Since: since.UnixNano()})
	if err != nil {
		return nil, err
	}
	return resp.Files, nil
}

// Limits asks the other end what the box's limits stopped (OpLimits):
// a kiln node answers it for the box it relays to; an agent refuses it.
func (c *AgentConn) Limits(ctx context.Context) (LimitHits, error) {
	resp, err := c.call(ctx, agentproto.Request{Op: agentproto.OpLimits})
	if err != nil {
		return LimitHits{OOMKills: -1, PidsRefused: -1}, err
	}
	return LimitHits{OOMKills: resp.Limits.OOMKills, PidsRefused: resp.Limits.PidsRefused}, nil
}

// Close closes the stream and destroys the box. Pending calls fail with
// ErrDied.
func (c *AgentConn) Close() error {
	c.closeOnce.Do(func() {
		err := c.stream.Close()
		if c.destroy != nil {
			err = errors.Join(err, c.destroy())
		}
		c.closeErr = err
	})
	return c.closeErr
}
