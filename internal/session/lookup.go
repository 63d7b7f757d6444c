package session

import (
	"context"
	"errors"

	"kiln/internal/sandbox"
)

// ErrNoBox is a session that has no live sandbox right now (never used,
// reset, or its box died): there is nothing in it to read.
var ErrNoBox = errors.New("the session has no sandbox right now; its files are gone")

// Lookup returns the principal's live session called name, without
// creating it; a session hibernated on disk counts as existing.
func (m *Manager) Lookup(principal, name string) (*Session, bool) {
	m.mu.Lock()
	s, ok := m.sessions[key{principal, name}]
	m.mu.Unlock()
	if !ok && m.hasSaved(principal, name) {
		if s, err := m.Get(principal, name); err == nil {
			return s, true
		}
	}
	return s, ok
}

// WithLiveBox runs f on the session's box on the session's turn, like
// WithBox, but never starts a box: a session without a live one gets
// ErrNoBox.
func (s *Session) WithLiveBox(ctx context.Context, f func(sandbox.Sandbox) error) error {
	if err := s.acquire(ctx); err != nil {
		return err
	}
	defer s.release()
	s.mu.Lock()
	box, lost := s.box, s.lost != ""
	s.mu.Unlock()
	if box == nil && !lost && s.m.hib != nil { // hibernated: wake it
		var err error
		if box, _, err = s.fromSaved(ctx, "", fromHibernation); err != nil {
			return err
		}
	}
	if box == nil || !alive(box) {
		return ErrNoBox
	}
	if err := cutIfOffline(ctx, box); err != nil {
		s.drop(box)
		return err
	}
	err := f(box)
	if s.isClosed() {
		return ErrReset
	}
	s.after(box, err)
	return err
}

// ReadFileAt keeps ranged reads visible through the wrapper.
func (b *countedBox) ReadFileAt(ctx context.Context, path string, off, max int64) ([]byte, int64, error) {
	if r, ok := b.Sandbox.(sandbox.RangeReader); ok {
		return r.ReadFileAt(ctx, path, off, max)
	}
	return nil, 0, sandbox.ErrNoRangedRead
}

var _ sandbox.RangeReader = (*countedBox)(nil)
