package session

import (
	"sort"
	"time"
)

// What sessions a principal has, live or saved, and how many may be live.

// Session states for SessionList.
const (
	StateLive       = "live"       // it has a sandbox
	StateNew        = "new"        // no sandbox yet, or since its last one was lost
	StateHibernated = "hibernated" // saved to disk; the next call resumes it
)

// SessionInfo is one of a principal's sessions, live or saved.
type SessionInfo struct {
	Name  string
	State string // StateLive, StateNew or StateHibernated
	// Saved is when its newest snapshot on disk was taken, and Bytes the
	// snapshot's size (zero: none).
	Saved    time.Time
	Bytes    int64
	LastUsed time.Time // live sessions
	// Unsaved: a call ran in the live session since its last save.
	Unsaved bool
}

// SessionList returns the principal's sessions: those in memory and those
// only on disk, by name.
func (m *Manager) SessionList(principal string) []SessionInfo {
	byName := map[string]SessionInfo{}
	if m.hib != nil {
		for _, si := range m.hib.st.listHib(principal) {
			byName[si.Name] = si
		}
	}
	m.mu.Lock()
	for k, s := range m.sessions {
		if k.principal != principal {
			continue
		}
		si := byName[k.name]
		si.Name = k.name
		s.mu.Lock()
		switch {
		case s.asleep() && !si.Saved.IsZero():
			si.State = StateHibernated
		case s.asleep(): // its save expired
			si.State, si.LastUsed = StateNew, s.lastUsed
		case s.box != nil:
			si.State, si.LastUsed = StateLive, s.lastUsed
			si.Unsaved = m.hib != nil && s.hib.dirty
		default:
			si.State, si.LastUsed = StateNew, s.lastUsed
			if !si.Saved.IsZero() && !s.hib.failed {
				si.State = StateHibernated // on disk, not yet resumed
			}
		}
		s.mu.Unlock()
		byName[k.name] = si
	}
	m.mu.Unlock()
	out := make([]SessionInfo, 0, len(byName))
	for _, si := range byName {
		out = append(out, si)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// isLive reports whether the principal's session is in memory with state
// that is not only on disk (it has a box, or will start a new one).
func (m *Manager) isLive(principal, name string) bool {
	m.mu.Lock()
	s, ok := m.sessions[key{principal, name}]
	m.mu.Unlock()
	if !ok {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.asleep()
}

// liveCounts counts the live sessions, not hibernated ones, in all and of
// principal, leaving out except. Call it with m.mu held.
func (m *Manager) liveCounts(principal string, except *Session) (total, owned int) {
	for k, s := range m.sessions {
		if s == except {
			continue
		}
		s.mu.Lock()
		asleep := s.asleep()
		s.mu.Unlock()
		if asleep {
			continue
		}
		total++
		if k.principal == principal {
			owned++
		}
	}
	return total, owned
}

// quotaFor is the error for one more live session of principal, or nil.
// Call it with m.mu held.
func (m *Manager) quotaFor(principal string, except *Session) error {
	total, owned := m.liveCounts(principal, except)
	if total >= m.opts.MaxSessions {
		return &QuotaError{Limit: m.opts.MaxSessions, Flag: "max-sessions"}
	}
	if owned >= m.opts.MaxSessionsPerPrincipal {
		return &QuotaError{Limit: m.opts.MaxSessionsPerPrincipal, Principal: true, Flag: "max-sessions-per-principal"}
	}
	return nil
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
