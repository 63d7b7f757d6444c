package session

// HibernateNow hibernates the principal's session at once, as the reaper
// does once it is idle past --hibernate-after (benchmarks, tests).
func (m *Manager) HibernateNow(principal, name string) bool {
	m.mu.Lock()
	s, ok := m.sessions[key{principal, name}]
	m.mu.Unlock()
	if !ok || m.hib == nil {
		return false
	}
	m.hibernate(s)
	return s.wasHibernated()
}
