package kubernetes

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	coordv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// heldLease is a Lease that says its holder is alive (a kiln node's, a
// front's): renewed three times per duration until Close, and deleted
// then.
type heldLease struct {
	cancel context.CancelFunc
	done   chan struct{}
	cs     kubernetes.Interface
	ns     string
	name   string
}

// holdLease renews l, taken, until Close. take takes it again when it was
// deleted or replaced meanwhile (an operator, or the API server lost it).
// lapsed, if not nil, is told after a renewal that came later than the
// duration: others may have taken the holder for dead meanwhile. whose
// names the Lease in logs ("this node's").
func holdLease(cs kubernetes.Interface, l *coordv1.Lease, d time.Duration, whose string, take func(context.Context) (*coordv1.Lease, error), lapsed func(), log *slog.Logger) *heldLease {
	ctx, cancel := context.WithCancel(context.Background())
	h := &heldLease{cancel: cancel, done: make(chan struct{}), cs: cs, ns: l.Namespace, name: l.Name}
	go h.renew(ctx, l, d, whose, take, lapsed, log)
	return h
}

func (h *heldLease) renew(ctx context.Context, l *coordv1.Lease, d time.Duration, whose string, take func(context.Context) (*coordv1.Lease, error), lapsed func(), log *slog.Logger) {
	defer close(h.done)
	t := time.NewTicker(d / 3)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		got, err := renewLease(ctx, h.cs, l)
		if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			got, err = take(ctx)
		}
		if err != nil {
			if ctx.Err() == nil {
				log.Warn("renewing "+whose+" Lease", "lease", l.Name, "err", err)
			}
			continue
		}
		if now := time.Now(); now.Sub(last) > d && lapsed != nil {
			lapsed()
		}
		l, last = got, time.Now()
	}
}

// Close stops renewing and deletes the Lease, so that others stop
// counting its holder at once.
func (h *heldLease) Close() error {
	h.cancel()
	<-h.done
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := h.cs.CoordinationV1().Leases(h.ns).Delete(ctx, h.name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting Lease %s: %w", h.name, err)
	}
	return nil
}

// leaseDefaults fills in a held Lease's options: its duration (def when
// 0; at least 3 s, since it is renewed three times per duration in whole
// seconds), its namespace (kiln's own) and its logger. what names the
// holder in the error.
func leaseDefaults(what string, d, def time.Duration, ns string, log *slog.Logger) (time.Duration, string, *slog.Logger, error) {
	if d == 0 {
		d = def
	}
	if d < 3*time.Second {
		return 0, "", nil, fmt.Errorf("%s Lease duration %v: it must be at least 3s", what, d)
	}
	if ns == "" {
		ns = inClusterNamespace()
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return d, ns, log, nil
}
