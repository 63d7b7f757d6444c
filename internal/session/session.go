// Package session owns kiln's sandboxes on behalf of clients: named
// sessions scoped to a principal, per-call mode, the warm pool, timeouts,
// idle expiry and teardown.
package session

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"sort"
	"sync"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// Mode says whether state persists between calls.
type Mode string

const (
	ModeSession Mode = "session"  // a session keeps its sandbox across calls
	ModePerCall Mode = "per-call" // every call gets a never-used sandbox
)

// Options configure a Manager. Zero values mean defaults.
type Options struct {
	Backend sandbox.Backend
	Mode    Mode
	Limits  sandbox.Limits
	Preload []string
	// DefaultTimeout applies when a call names none; MaxTimeout caps what
	// a call may ask for.
	DefaultTimeout, MaxTimeout time.Duration
	// Grace is how long an interrupted call may take to stop before its
	// sandbox is destroyed.
	Grace       time.Duration
	IdleTTL     time.Duration
	MaxSessions int // live sessions across all principals
	MaxOutput   int // bytes kept per stream
	PoolSize    int
	PoolWorkers int
	Logger      *slog.Logger
}

func (o *Options) defaults() {
	if o.Mode == "" {
		o.Mode = ModeSession
	}
	if o.DefaultTimeout == 0 {
		o.DefaultTimeout = 30 * time.Second
	}
	if o.MaxTimeout == 0 {
		o.MaxTimeout = 300 * time.Second
	}
	if o.DefaultTimeout > o.MaxTimeout {
		o.DefaultTimeout = o.MaxTimeout
	}
	if o.Grace == 0 {
		o.Grace = 2 * time.Second
	}
	if o.IdleTTL == 0 {
		o.IdleTTL = 30 * time.Minute
	}
	if o.MaxSessions == 0 {
		o.MaxSessions = 32
	}
	if o.MaxOutput == 0 {
		o.MaxOutput = 20000
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	o.Limits = o.Limits.WithDefaults()
}

// Errors a client can act on.
var (
	ErrBadName     = errors.New("session names are 1-64 letters, digits, '.', '_' or '-'")
	ErrTooMany     = errors.New("too many live sessions; reset_session one you no longer need")
	ErrPerCallMode = errors.New("this server runs in per-call mode: nothing persists between calls")
	ErrShutdown    = errors.New("kiln is shutting down")
)

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// ValidName reports whether a client-chosen session name is acceptable.
func ValidName(name string) bool { return nameRE.MatchString(name) }

type key struct{ principal, name string }

// Manager holds the sessions of every principal.
type Manager struct {
	opts Options
	log  *slog.Logger
	pool *Pool

	mu       sync.Mutex
	sessions map[key]*Session
	closed   bool
	stop     chan struct{}
	wg       sync.WaitGroup
	// destroying counts per-call boxes being destroyed after their call.
	destroying sync.WaitGroup
}

// NewManager starts the pool and the idle reaper.
func NewManager(opts Options) *Manager {
	opts.defaults()
	m := &Manager{
		opts:     opts,
		log:      opts.Logger,
		sessions: make(map[key]*Session),
		stop:     make(chan struct{}),
	}
	spec := sandbox.Spec{Limits: opts.Limits, Preload: opts.Preload}
	m.pool = NewPool(opts.Backend, spec, PoolOptions{Size: opts.PoolSize, Concurrency: opts.PoolWorkers, Logger: opts.Logger})
	m.wg.Add(1)
	go m.reap()
	return m
}

// Options returns the effective options (defaults filled in).
func (m *Manager) Options() Options { return m.opts }

// Timeout clamps a requested timeout in seconds (0: the default).
func (m *Manager) Timeout(seconds float64) time.Duration {
	if seconds <= 0 {
		return m.opts.DefaultTimeout
	}
	d := time.Duration(seconds * float64(time.Second))
	return min(d, m.opts.MaxTimeout)
}

func (m *Manager) reap() {
	defer m.wg.Done()
	t := time.NewTicker(min(m.opts.IdleTTL/4, time.Minute))
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
		}
		m.mu.Lock()
		var idle []*Session
		for k, s := range m.sessions {
			if s.idleSince(m.opts.IdleTTL) {
				delete(m.sessions, k)
				idle = append(idle, s)
			}
		}
		m.mu.Unlock()
		for _, s := range idle {
			m.log.Info("session expired", "session", s.name, "principal", s.principal)
			s.close()
		}
	}
}

// Get returns the principal's session called name, creating it.
func (m *Manager) Get(principal, name string) (*Session, error) {
	if m.opts.Mode == ModePerCall {
		return nil, ErrPerCallMode
	}
	if !ValidName(name) {
		return nil, ErrBadName
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, ErrShutdown
	}
	k := key{principal, name}
	if s, ok := m.sessions[k]; ok {
		return s, nil
	}
	if len(m.sessions) >= m.opts.MaxSessions {
		return nil, ErrTooMany
	}
	s := &Session{m: m, principal: principal, name: name, lastUsed: time.Now()}
	m.sessions[k] = s
	return s, nil
}

// Reset destroys the principal's session called name, if it exists.
func (m *Manager) Reset(principal, name string) bool {
	m.mu.Lock()
	s, ok := m.sessions[key{principal, name}]
	delete(m.sessions, key{principal, name})
	m.mu.Unlock()
	if ok {
		s.close()
	}
	return ok
}

// Sessions lists the principal's session names.
func (m *Manager) Sessions(principal string) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for k := range m.sessions {
		if k.principal == principal {
			out = append(out, k.name)
		}
	}
	sort.Strings(out)
	return out
}

// Close destroys every session and the pool.
func (m *Manager) Close() {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	m.closed = true
	all := m.sessions
	m.sessions = map[key]*Session{}
	m.mu.Unlock()
	close(m.stop)
	m.wg.Wait()
	var wg sync.WaitGroup
	for _, s := range all {
		wg.Add(1)
		go func() { defer wg.Done(); s.close() }()
	}
	wg.Wait()
	m.pool.Close()
	m.destroying.Wait()
}

// Outcome is what one call produced, with what kiln did about it.
type Outcome struct {
	*agentproto.ExecResult
	Session  string        // the session it ran in ("" in per-call mode)
	Duration time.Duration // wall time of the call
	TimedOut bool
	// Restarted is true when the sandbox was destroyed (timeout that did
	// not stop, the box died): the session's state is gone.
	Restarted bool
	// Fresh is true when this call started a new sandbox for the session.
	Fresh bool
	Note  string // what kiln did, for the model
	Files []agentproto.FileInfo
}

// Session is one named sandbox lifetime: its box is created on first use
// and replaced after a reset or a crash.
type Session struct {
	m         *Manager
	principal string
	name      string

	mu       sync.Mutex // serializes calls
	box      sandbox.Sandbox
	lastUsed time.Time
	busy     bool
	closed   bool
}

// Name is the session's name, as the model passes it back.
func (s *Session) Name() string { return s.name }

func (s *Session) idleSince(ttl time.Duration) bool {
	if !s.mu.TryLock() {
		return false // a call is running
	}
	defer s.mu.Unlock()
	return time.Since(s.lastUsed) > ttl
}

func (s *Session) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.box != nil {
		s.box.Close()
		s.box = nil
	}
}

// ensure returns the session's live box, replacing a dead one. Call with
// s.mu held.
func (s *Session) ensure(ctx context.Context) (box sandbox.Sandbox, fresh bool, note string, err error) {
	if s.closed {
		return nil, false, "", errors.New("the session was reset while this call waited; call again")
	}
	if s.box != nil {
		select {
		case <-s.box.Done():
			s.box.Close()
			s.box = nil
			note = "the previous sandbox had died (memory limit or a crash); this call runs in a new one and earlier state is gone"
		default:
			return s.box, false, "", nil
		}
	}
	box, err = s.m.pool.Get(ctx)
	if err != nil {
		return nil, false, note, fmt.Errorf("starting sandbox: %w", err)
	}
	s.box = box
	return box, true, note, nil
}

// RunPython runs a cell in the session's kernel.
func (s *Session) RunPython(ctx context.Context, code string, timeout time.Duration) (*Outcome, error) {
	return s.exec(ctx, timeout, func(ctx context.Context, box sandbox.Sandbox) (*agentproto.ExecResult, error) {
		return box.RunPython(ctx, code, sandbox.ExecOptions{MaxOutput: s.m.opts.MaxOutput})
	})
}

// RunShell runs a bash command in the session's workspace.
func (s *Session) RunShell(ctx context.Context, command string, timeout time.Duration) (*Outcome, error) {
	return s.exec(ctx, timeout, func(ctx context.Context, box sandbox.Sandbox) (*agentproto.ExecResult, error) {
		return box.RunShell(ctx, command, sandbox.ExecOptions{MaxOutput: s.m.opts.MaxOutput})
	})
}

func (s *Session) exec(ctx context.Context, timeout time.Duration, run runFunc) (*Outcome, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer func() { s.lastUsed = time.Now() }()
	box, fresh, note, err := s.ensure(ctx)
	if err != nil {
		return nil, err
	}
	out, err := s.m.runBounded(ctx, box, timeout, run)
	if out != nil {
		out.Session, out.Fresh = s.name, fresh
		if note != "" {
			out.Note = joinNote(note, out.Note)
		}
		if out.Restarted {
			s.box = nil
		}
	}
	return out, err
}

// WithBox runs f on the session's box (file operations).
func (s *Session) WithBox(ctx context.Context, f func(sandbox.Sandbox) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer func() { s.lastUsed = time.Now() }()
	box, _, _, err := s.ensure(ctx)
	if err != nil {
		return err
	}
	return f(box)
}

type runFunc func(context.Context, sandbox.Sandbox) (*agentproto.ExecResult, error)

type runResult struct {
	res *agentproto.ExecResult
	err error
}

// runBounded runs one call under the timeout: at the deadline (or when
// the client goes away) it interrupts; if the call does not stop within
// the grace period the box is destroyed.
func (m *Manager) runBounded(ctx context.Context, box sandbox.Sandbox, timeout time.Duration, run runFunc) (*Outcome, error) {
	start := time.Now()
	callCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan runResult, 1)
	go func() {
		res, err := run(callCtx, box)
		done <- runResult{res, err}
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()

	finish := func(r runResult) (*Outcome, error) {
		out := &Outcome{ExecResult: r.res, Duration: time.Since(start)}
		if r.err != nil {
			if errors.Is(r.err, sandbox.ErrDied) {
				box.Close()
				out.ExecResult = &agentproto.ExecResult{Error: &agentproto.ExecError{
					Name: "SandboxDied", Value: m.diedReason(box),
				}}
				out.Restarted = true
				out.Note = "the sandbox died during the call and was replaced; the next call starts fresh"
				return out, nil
			}
			var ae *sandbox.AgentError
			if errors.As(r.err, &ae) {
				return nil, ae
			}
			return nil, r.err
		}
		return out, nil
	}

	var why string
	select {
	case r := <-done:
		out, err := finish(r)
		if rr, ok := box.(sandbox.RefusalReporter); ok && out != nil {
			seen := map[string]bool{}
			for _, refusal := range rr.NetworkRefusals() {
				if !seen[refusal] {
					seen[refusal] = true
					out.Note = joinNote(out.Note, refusal)
				}
			}
		}
		return out, err
	case <-timer.C:
		why = fmt.Sprintf("timed out after %s", timeout.Round(time.Millisecond))
	case <-ctx.Done():
		why = "the client cancelled the call"
	}
	ictx, icancel := context.WithTimeout(context.Background(), m.opts.Grace)
	box.Interrupt(ictx)
	icancel()
	select {
	case r := <-done:
		out, err := finish(r)
		if out != nil {
			out.TimedOut = true
			out.Note = joinNote(why+"; the call was interrupted and the session kept its state", out.Note)
		}
		return out, err
	case <-time.After(m.opts.Grace):
	}
	box.Close()
	cancel()
	m.log.Info("destroyed a sandbox that did not stop", "reason", why)
	return &Outcome{
		ExecResult: &agentproto.ExecResult{Error: &agentproto.ExecError{Name: "Timeout", Value: why}},
		Duration:   time.Since(start),
		TimedOut:   true,
		Restarted:  true,
		Note:       why + "; the code did not stop when interrupted, so its sandbox was destroyed and the session restarted (variables and files are gone)",
	}, nil
}

// oomReporter is implemented by boxes that know whether they hit their
// memory limit.
type oomReporter interface{ OOMKilled() bool }

func (m *Manager) diedReason(box sandbox.Sandbox) string {
	if o, ok := box.(oomReporter); ok && o.OOMKilled() {
		return fmt.Sprintf("the sandbox hit its memory limit (%d MiB) and was killed", m.opts.Limits.MemoryBytes>>20)
	}
	return "the sandbox died (memory limit, or a crash)"
}

func joinNote(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "; " + b
}
