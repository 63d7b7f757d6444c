package session_test

import (
	"context"
	"slices"
	"sync"
	"testing"

	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// urgentRecorder notes sandbox.Spec.Urgent of every box asked for.
type urgentRecorder struct {
	*sessiontest.Backend
	mu     sync.Mutex
	urgent []bool
}

func (r *urgentRecorder) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	r.mu.Lock()
	r.urgent = append(r.urgent, spec.Urgent)
	r.mu.Unlock()
	return r.Backend.Create(ctx, spec)
}

func (r *urgentRecorder) seen() []bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.urgent)
}

// TestUrgentBoxes: a box made for a waiting call is urgent (a backend may
// then skip a template still warming); a box the pool makes ahead of
// demand is not.
func TestUrgentBoxes(t *testing.T) {
	for _, c := range []struct {
		name string
		pool int
		want bool
	}{
		{"pool refill", 1, false},
		{"call without a pool", 0, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			rec := &urgentRecorder{Backend: sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})}
			mgr := session.NewManager(session.Options{Backend: rec, PoolSize: c.pool})
			t.Cleanup(func() { finishes(t, "closing the manager", mgr.Close) })
			if c.pool == 0 {
				if _, err := getSession(t, mgr, "s").RunPython(context.Background(), "1", liveness); err != nil {
					t.Fatal(err)
				}
			}
			waitUntil(t, func() bool { return len(rec.seen()) > 0 }, "a box to be asked for")
			if got := rec.seen()[0]; got != c.want {
				t.Errorf("first box: Urgent = %v, want %v", got, c.want)
			}
		})
	}
}
