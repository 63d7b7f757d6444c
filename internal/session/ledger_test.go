package session_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// memLedgers is session.Ledger shared in memory by the servers of a test,
// as the cluster's API is shared by its fronts (the Kubernetes one is
// tested on a real cluster by kubernetes.TestSessionLedger).
type memLedgers struct {
	mu      sync.Mutex
	entries map[string]map[string][]string // server: principal: names
	down    bool                           // every claim fails
}

func (l *memLedgers) server(name string) *memLedger {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.entries == nil {
		l.entries = map[string]map[string][]string{}
	}
	l.entries[name] = map[string][]string{}
	return &memLedger{all: l, name: name}
}

// count is the names recorded for principal across the servers.
func (l *memLedgers) count(principal string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, e := range l.entries {
		n += len(e[principal])
	}
	return n
}

type memLedger struct {
	all  *memLedgers
	name string
	live func(string) []string
}

func (l *memLedger) Bind(live func(string) []string) { l.live = live }

func (l *memLedger) Claim(_ context.Context, principal string, limit int) (bool, int, error) {
	l.all.mu.Lock()
	defer l.all.mu.Unlock()
	if l.all.down {
		return false, 0, errors.New("the API server is away")
	}
	others := 0
	for name, e := range l.all.entries {
		if name != l.name {
			others += len(e[principal])
		}
	}
	mine := l.live(principal)
	if others+len(mine) > limit {
		return false, others + len(mine) - 1, nil
	}
	l.all.entries[l.name][principal] = mine
	return true, others + len(mine) - 1, nil
}

func (l *memLedger) Sync(principal string) {
	go func() {
		l.all.mu.Lock()
		defer l.all.mu.Unlock()
		l.all.entries[l.name][principal] = l.live(principal)
	}()
}

// TestLedgerAcrossServers: two servers sharing a ledger hold one
// principal's quota together. The control is the first server alone,
// which admits what the quota allows.
func TestLedgerAcrossServers(t *testing.T) {
	var ledgers memLedgers
	a, _ := inProcess(t, session.Options{MaxSessionsPerPrincipal: 2, Ledger: ledgers.server("a")})
	b, _ := inProcess(t, session.Options{MaxSessionsPerPrincipal: 2, Ledger: ledgers.server("b")})
	if _, err := a.Get("p", "one"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Get("p", "two"); err != nil {
		t.Fatal(err)
	}
	_, err := a.Get("p", "three")
	var q *session.QuotaError
	if !errors.As(err, &q) || !q.Cluster || q.Held != 2 {
		t.Fatalf("a third session across two servers of a quota of 2: %v", err)
	}
	if !strings.Contains(err.Error(), "across this kiln cluster") || !strings.Contains(err.Error(), "--max-sessions-per-principal") {
		t.Errorf("the refusal does not say it counts the cluster, or its flag: %v", err)
	}
	if n := ledgers.count("p"); n != 2 {
		t.Errorf("the ledger holds %d of p's sessions after a refusal, want 2", n)
	}
	if _, err := a.Get("p", "one"); err != nil {
		t.Errorf("an existing session is refused at the cap: %v", err)
	}
	if _, err := b.Get("other", "x"); err != nil {
		t.Errorf("another principal is refused: %v", err)
	}
	// A reset on one server makes room on the other.
	b.Reset("p", "two")
	waitUntil(t, func() bool { return ledgers.count("p") == 1 }, "the reset to be counted out")
	if _, err := a.Get("p", "three"); err != nil {
		t.Errorf("after a reset on the other server: %v", err)
	}
	// Calls for one new name at once make one session, counted once.
	var wg sync.WaitGroup
	got := make([]*session.Session, 8)
	b.Reset("p", "three")
	a.Reset("p", "three")
	waitUntil(t, func() bool { return ledgers.count("p") == 1 }, "the resets to be counted out")
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], _ = b.Get("p", "same")
		}()
	}
	wg.Wait()
	if got[0] == nil || slices.ContainsFunc(got, func(s *session.Session) bool { return s != got[0] }) {
		t.Errorf("eight calls for one new session: %v", got)
	}
	if n := ledgers.count("p"); n != 2 {
		t.Errorf("the ledger holds %d of p's sessions, want 2", n)
	}
}

// TestLedgerDown: when the ledger cannot be reached, a new session is
// refused with a clear error, and the live ones go on.
func TestLedgerDown(t *testing.T) {
	var ledgers memLedgers
	a, _ := inProcess(t, session.Options{Ledger: ledgers.server("a")})
	s, err := a.Get("p", "live")
	if err != nil {
		t.Fatal(err)
	}
	ledgers.mu.Lock()
	ledgers.down = true
	ledgers.mu.Unlock()
	_, err = a.Get("p", "new")
	if err == nil || !strings.Contains(err.Error(), "could not count your live sessions across its cluster") {
		t.Errorf("a new session with the ledger away: %v", err)
	}
	if again, err := a.Get("p", "live"); err != nil || again != s {
		t.Errorf("the live session with the ledger away: %v", err)
	}
}

// TestLedgerWake: a hibernated session is out of the count, and waking it
// is a claim: refused while the principal's quota is full on another
// server, admitted once there is room.
func TestLedgerWake(t *testing.T) {
	var ledgers memLedgers
	backend := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	h := session.HibernateOptions{After: 200 * time.Millisecond, CheckpointEvery: -1}
	a := hibernating(t, backend, t.TempDir(), h, session.Options{MaxSessionsPerPrincipal: 1, Ledger: ledgers.server("a")})
	b, _ := inProcess(t, session.Options{MaxSessionsPerPrincipal: 1, Ledger: ledgers.server("b")})
	hibRun(t, a, "p", "sleepy", "x = 1")
	waitUntil(t, func() bool {
		return stateOf(a, "p", "sleepy").State == session.StateHibernated && ledgers.count("p") == 0
	}, "the session to hibernate and be counted out")
	if _, err := b.Get("p", "awake"); err != nil {
		t.Fatalf("with p's only session hibernated: %v", err)
	}
	s, err := a.Get("p", "sleepy")
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.RunPython(context.Background(), "x", liveness)
	var q *session.QuotaError
	if !errors.As(err, &q) || !q.Cluster {
		t.Fatalf("waking past the cluster's quota: %v", err)
	}
	if n := ledgers.count("p"); n != 1 {
		t.Errorf("after the refused wake the ledger holds %d of p's sessions, want 1", n)
	}
	b.Reset("p", "awake")
	waitUntil(t, func() bool { return ledgers.count("p") == 0 }, "the reset to be counted out")
	out := hibRun(t, a, "p", "sleepy", "x")
	if out.Result["text/plain"] != "1" || !strings.Contains(out.Note, resumedNote) {
		t.Errorf("waking within the quota: %+v %q", out.ExecResult, out.Note)
	}
	if n := ledgers.count("p"); n != 1 {
		t.Errorf("after the wake the ledger holds %d of p's sessions, want 1", n)
	}
}
