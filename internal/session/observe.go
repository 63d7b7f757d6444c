package session

import (
	"context"
	"errors"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/event"
	"kiln/internal/sandbox"
)

// What the Manager tells its Observer (the audit log and the metrics):
// one event per execution, session change and box creation. The result
// class of an execution is decided where its outcome is made
// (runBounded), from the same limit counters the model's note is written
// from, so the two never disagree.

// outcomeClass is how an outcome is accounted for.
type outcomeClass struct {
	box    string // the box's ID
	result string // an event.Result* class; "" until decided
	hit    []string
}

func (c *outcomeClass) limit(name string) {
	for _, h := range c.hit {
		if h == name {
			return
		}
	}
	c.hit = append(c.hit, name)
}

// died classifies a call whose box died under it.
func (c *outcomeClass) died(box sandbox.Sandbox, d sandbox.LimitHits) {
	c.result = event.ResultKilled
	if oom, _ := oomKnown(box, d); oom {
		c.result = event.ResultOOM
		c.limit(event.LimitMemory)
	}
}

// finished classifies a call that returned a result from a live box.
func (c *outcomeClass) finished(res *agentproto.ExecResult, box sandbox.Sandbox, d sandbox.LimitHits, l sandbox.Limits) {
	c.result = event.ResultOK
	if res == nil {
		return
	}
	if res.Error != nil || res.ExitCode != 0 || res.Signal != "" {
		c.result = event.ResultError
	}
	if oom, _ := oomKnown(box, d); oom {
		c.result = event.ResultOOM
		c.limit(event.LimitMemory)
	} else if res.Error != nil && res.Error.Name == "KernelDied" {
		c.result = event.ResultKilled
	}
	if d.PidsRefused > 0 {
		c.limit(event.LimitPids)
	}
	if diskFull(res, l) != "" {
		c.limit(event.LimitDisk)
	}
}

// interrupted classifies a call cut off at its deadline or by its client.
func (c *outcomeClass) interrupted(cancelled bool) {
	if c.result == event.ResultOOM {
		return // the memory limit ended it first
	}
	if cancelled {
		c.result = event.ResultCancelled
		return
	}
	c.result = event.ResultTimeout
	c.limit(event.LimitTime)
}

// errorClass classifies a call that ended in an error instead of an
// outcome.
func errorClass(ctx context.Context, err error) string {
	switch {
	case errors.Is(err, ErrBusy):
		return event.ResultBusy
	case errors.Is(err, ErrReset):
		return event.ResultKilled
	case ctx.Err() != nil || errors.Is(err, context.Canceled):
		return event.ResultCancelled
	}
	return event.ResultFault
}

func (m *Manager) backendName() string {
	if m.opts.Backend == nil {
		return ""
	}
	return m.opts.Backend.Name()
}

// observeExec reports one execution.
func (m *Manager) observeExec(ctx context.Context, principal, session string, lang Language, code string, out *Outcome, err error) {
	if m.opts.Observer == nil {
		return
	}
	e := event.Exec{
		Time: time.Now(), Principal: principal, Session: session, Backend: m.backendName(),
		Language: "python", Code: code,
	}
	if lang == Shell {
		e.Language = "shell"
	}
	switch {
	case out != nil:
		e.Box, e.Result, e.LimitsHit = out.obs.box, out.obs.result, out.obs.hit
		e.Duration, e.Restarted = out.Duration, out.Restarted
		if e.Result == "" {
			e.Result = event.ResultOK
		}
		if out.ExecResult != nil {
			e.StdoutBytes, e.StderrBytes = out.Stdout.Total, out.Stderr.Total
		}
	default:
		e.Result = errorClass(ctx, err)
	}
	m.opts.Observer.Observe(e)
}

// observeSession reports a change in a session's life.
func (m *Manager) observeSession(op string, s *Session) {
	if m.opts.Observer == nil {
		return
	}
	m.opts.Observer.Observe(event.Session{
		Time: time.Now(), Op: op, Principal: s.principal, Session: s.name, Backend: m.backendName(),
	})
}

type principalKey struct{}

// WithPrincipal returns ctx naming the caller, for what RunOnce reports:
// per-call runs have no session to hold it.
func WithPrincipal(ctx context.Context, principal string) context.Context {
	return context.WithValue(ctx, principalKey{}, principal)
}

func principalOf(ctx context.Context) string {
	p, _ := ctx.Value(principalKey{}).(string)
	return p
}

// Stats is a reading of what the Manager holds, for the metrics.
type Stats struct {
	Sessions  int // live named sessions
	Boxes     int // live boxes: sessions', per-call, the pool's, being destroyed
	PoolReady int // boxes ready in the pool
	PoolSize  int // boxes the pool is asked to keep ready
	Closed    bool
}

// Stats reads the Manager's counts.
func (m *Manager) Stats() Stats {
	m.mu.Lock()
	st := Stats{Sessions: len(m.sessions), Closed: m.closed}
	m.mu.Unlock()
	st.Boxes = m.slots.inUse()
	st.PoolReady = len(m.pool.ready)
	st.PoolSize = m.pool.size
	return st
}

// BoxMemory reads the memory in use of every box that runs calls (the
// sessions' and the per-call ones; pooled boxes are idle) whose backend
// reports it, in bytes.
func (m *Manager) BoxMemory() []int64 {
	m.mu.Lock()
	boxes := make([]sandbox.Sandbox, 0, len(m.sessions)+len(m.calls))
	for _, s := range m.sessions {
		s.mu.Lock()
		if s.box != nil {
			boxes = append(boxes, s.box)
		}
		s.mu.Unlock()
	}
	for b := range m.calls {
		boxes = append(boxes, b)
	}
	m.mu.Unlock()
	var out []int64
	for _, b := range boxes {
		if r, ok := inner(b).(sandbox.MemoryReporter); ok {
			if n := r.MemoryUsage(); n >= 0 {
				out = append(out, n)
			}
		}
	}
	return out
}
