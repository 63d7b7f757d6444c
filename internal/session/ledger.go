package session

import (
	"context"
	"fmt"
	"sort"
	"time"
)

// A Ledger holds MaxSessionsPerPrincipal across every server that shares
// it (the fronts of a cluster), not only in this one. Each server records
// in it the names of its live sessions of a principal; a new live session
// is admitted only when they and the other servers' stay within the
// limit. The ledger asks the manager for those names itself, at the
// moment it writes them, so that a write never records an old view.
type Ledger interface {
	// Bind gives the ledger the names of this server's live sessions of a
	// principal (the ones being admitted among them). Managers call it
	// once, at start.
	Bind(live func(principal string) []string)
	// Claim records this server's live sessions of principal, the one
	// being admitted among them, if with the other servers' they are at
	// most limit. held is then the count across the servers without the
	// new one. err is a failure to reach the ledger: the session is
	// refused, since nothing could be counted.
	Claim(ctx context.Context, principal string, limit int) (admitted bool, held int, err error)
	// Sync records them again after one ended, without waiting.
	Sync(principal string)
}

// ledgerWait bounds one claim in the ledger.
const ledgerWait = 10 * time.Second

// admit counts one more live session of principal in the ledger: s is
// the session being woken, nil for a new one called name. The caller
// holds neither lock, and calls done (which always comes back) once the
// session is in m.sessions and awake, or has failed to be.
func (m *Manager) admit(principal, name string) (done func(), err error) {
	if m.opts.Ledger == nil {
		return func() {}, nil
	}
	k := key{principal, name}
	m.mu.Lock()
	m.admitting[k]++
	m.mu.Unlock()
	done = func() {
		m.mu.Lock()
		if m.admitting[k]--; m.admitting[k] <= 0 {
			delete(m.admitting, k)
		}
		m.mu.Unlock()
	}
	ctx, cancel := context.WithTimeout(context.Background(), ledgerWait)
	defer cancel()
	ok, held, err := m.opts.Ledger.Claim(ctx, principal, m.opts.MaxSessionsPerPrincipal)
	if err != nil {
		done()
		m.log.Warn("refused a session: its principal's sessions across the cluster could not be counted", "principal", principal, "session", name, "err", err)
		return nil, fmt.Errorf("kiln could not count your live sessions across its cluster (%v), so it started no new one; retry in a little while, or continue in an existing session", err)
	}
	if !ok {
		done()
		return nil, &QuotaError{Limit: m.opts.MaxSessionsPerPrincipal, Principal: true, Cluster: true, Held: held, Flag: "max-sessions-per-principal"}
	}
	return done, nil
}

// liveNames are the names of principal's live sessions in this server and
// of those being admitted, for the ledger.
func (m *Manager) liveNames(principal string) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	seen := map[string]bool{}
	for k := range m.admitting {
		if k.principal == principal {
			seen[k.name] = true
		}
	}
	for k, s := range m.sessions {
		if k.principal != principal || seen[k.name] {
			continue
		}
		s.mu.Lock()
		if !s.asleep() || s.hib.waking {
			seen[k.name] = true
		}
		s.mu.Unlock()
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// ledgerSync tells the ledger that principal's live sessions changed.
func (m *Manager) ledgerSync(principal string) {
	if m.opts.Ledger != nil {
		m.opts.Ledger.Sync(principal)
	}
}
