package session

import (
	"time"

	"kiln/internal/event"
)

// The reaper: every reapEvery it hibernates or checkpoints what is due
// (hibernate.go) and drops sessions idle past the TTL.

// reap runs the reaper until the manager closes.
func (m *Manager) reap() {
	defer m.wg.Done()
	t := time.NewTicker(m.reapEvery())
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
		}
		if m.hib != nil {
			m.hibernateIdle()
		}
		m.mu.Lock()
		var idle []*Session
		for k, s := range m.sessions {
			if s.idleSince(m.opts.IdleTTL) && s.expirable() {
				delete(m.sessions, k)
				idle = append(idle, s)
			}
		}
		m.mu.Unlock()
		for _, s := range idle {
			m.ledgerSync(s.principal)
			if s.wasHibernated() { // its state is on disk; only the name is forgotten here
				s.close()
				continue
			}
			m.log.Info("session expired", "session", s.name, "principal", s.principal)
			m.observeSession(event.SessionExpire, s)
			s.close()
		}
	}
}

// reapEvery is how often the reaper looks at the sessions.
func (m *Manager) reapEvery() time.Duration {
	d := min(m.opts.IdleTTL/4, time.Minute)
	if h := m.hib; h != nil {
		d = min(d, h.opts.After/4)
		if h.opts.CheckpointEvery > 0 {
			d = min(d, h.opts.CheckpointEvery/4)
		}
	}
	return max(d, 10*time.Millisecond)
}
