package session

import (
	"context"
	"errors"

	"kiln/internal/sandbox"
)

// A backend whose boxes outlive this process (sandbox.Adopter: kubernetes)
// lets a session continue through whichever kiln replica its client
// reaches: a session's new box is bound to its key, and before a session
// makes a new box it adopts the box its key holds, if any.

// sessionKey names a session across replicas: its principal and name.
func sessionKey(principal, name string) string { return principal + "\x00" + name }

// adopt returns the box of s's key that another replica (or an earlier run
// of this one) holds, taken over, under the cap on live boxes; nil if
// there is none or the backend cannot adopt.
func (m *Manager) adopt(ctx context.Context, s *Session) sandbox.Sandbox {
	a, ok := m.opts.Backend.(sandbox.Adopter)
	if !ok {
		return nil
	}
	if !m.slots.tryIdle() {
		return nil
	}
	box, err := a.Adopt(ctx, sessionKey(s.principal, s.name))
	if err != nil {
		m.slots.release()
		if !errors.Is(err, sandbox.ErrNoBox) {
			m.log.Warn("adopting a session's box", "session", s.name, "err", err)
		}
		return nil
	}
	m.log.Info("continuing a session in the box another replica made", "session", s.name, "box", box.ID())
	counted, err := cutOrClose(ctx, &countedBox{Sandbox: box, release: m.slots.release})
	if err != nil {
		m.log.Warn("cutting an adopted box off the network; it was destroyed", "session", s.name, "err", err)
		return nil
	}
	return counted
}

// bind records that box holds s, for the replicas that may adopt it.
func (m *Manager) bind(ctx context.Context, s *Session, box sandbox.Sandbox) {
	if a, ok := m.opts.Backend.(sandbox.Adopter); ok {
		if err := a.Bind(ctx, box, sessionKey(s.principal, s.name)); err != nil {
			m.log.Warn("binding a session's box", "session", s.name, "err", err)
		}
	}
}

// release leaves s's live box, at shutdown, to the replica that adopts it
// next (sandbox.Releaser), rather than destroy it with s.
func (m *Manager) release(s *Session) {
	r, ok := m.opts.Backend.(sandbox.Releaser)
	if !ok {
		return
	}
	s.mu.Lock()
	box := s.box
	s.mu.Unlock()
	if box == nil || !alive(box) {
		return
	}
	if err := r.Release(box); err != nil {
		m.log.Debug("a session's box is destroyed at shutdown, not left for another replica", "session", s.name, "err", err)
		return
	}
	m.log.Debug("a session's box is left for another replica at shutdown", "session", s.name, "box", box.ID())
}
