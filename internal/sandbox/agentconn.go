package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"kiln/internal/agentproto"
)

// AgentConn is the host-side client of kiln-agent's protocol. Backends that
// host the agent wrap their byte stream in one and get the whole Sandbox
// interface; they supply only how to destroy the box.
type AgentConn struct {
	id      string
	stream  io.ReadWriteCloser
	destroy func() error
	hello   agentproto.Hello

	wmu     sync.Mutex // serializes frames on the stream
	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]chan *agentproto.Response
	done    chan struct{}
	readErr error

	closeOnce sync.Once
	closeErr  error
}

var _ Sandbox = (*AgentConn)(nil)

// NewAgentConn waits for the agent's hello on stream and returns the client.
// destroy tears the box down; it is called once, by Close, after the stream
// is closed. If ctx ends before the hello, the box is destroyed.
func NewAgentConn(ctx context.Context, id string, stream io.ReadWriteCloser, destroy func() error) (*AgentConn, error) {
	c := &AgentConn{
		id:      id,
		stream:  stream,
		destroy: destroy,
		pending: make(map[uint64]chan *agentproto.Response),
		done:    make(chan struct{}),
	}
	helloc := make(chan error, 1)
	go func() { helloc <- agentproto.ReadFrame(stream, &c.hello) }()
	select {
	case err := <-helloc:
		if err == nil && c.hello.Error != "" {
			err = errors.New(c.hello.Error)
		}
		if err != nil {
			c.Close()
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

func (c *AgentConn) readLoop() {
	var err error
	for {
		resp := new(agentproto.Response)
		if err = agentproto.ReadFrame(c.stream, resp); err != nil {
			break
		}
		c.mu.Lock()
		ch := c.pending[resp.ID]
		delete(c.pending, resp.ID)
		c.mu.Unlock()
		if ch != nil {
			ch <- resp
		}
	}
	c.mu.Lock()
	c.readErr = err
	c.pending = nil
	c.mu.Unlock()
	close(c.done)
}

// call sends req and waits for its response, the box's death or ctx.
func (c *AgentConn) call(ctx context.Context, req agentproto.Request) (*agentproto.Response, error) {
	ch := make(chan *agentproto.Response, 1)
	c.mu.Lock()
	if c.pending == nil {
		c.mu.Unlock()
		return nil, ErrDied
	}
	c.nextID++
	req.ID = c.nextID
	c.pending[req.ID] = ch
	c.mu.Unlock()

	c.wmu.Lock()
	err := agentproto.WriteFrame(c.stream, &req)
	c.wmu.Unlock()
	if err != nil {
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
		return nil, ErrDied
	case <-ctx.Done():
		c.forget(req.ID)
		return nil, ctx.Err()
	}
}

func (c *AgentConn) forget(id uint64) {
	c.mu.Lock()
	if c.pending != nil {
		delete(c.pending, id)
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
	resp, err := c.call(ctx, agentproto.Request{Op: op, Code: code, MaxOutput: opts.MaxOutput})
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
