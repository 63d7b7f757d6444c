package kubernetes

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	coordv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
)

// SessionLedger is session.Ledger in the cluster's API, so that
// --max-sessions-per-principal holds across every front of a cluster.
//
// Each front holds a Lease of its own, kiln-front-<name>, renewed while it
// serves. Each principal that has live sessions has a Lease,
// kiln-sessions-<hash of the principal>, whose annotation maps each front
// to the names of its live sessions of that principal. A front admits a
// new session by writing its own names, the new one among them, only if
// with the other live fronts' they are within the limit. The write is
// guarded by the Lease's resourceVersion: of two fronts that take the last
// place at once, one fails and counts again. A front whose Lease lapsed is
// dead: its names are not counted, and the next write drops them.
type SessionLedger struct {
	cs    kubernetes.Interface
	ns    string
	front string
	hold  *heldLease
	log   *slog.Logger
	live  func(principal string) []string

	mu      sync.Mutex          // one write at a time
	written map[string][]string // principal: the names last written

	dirtyMu sync.Mutex
	dirty   map[string]bool // principals to write again
	kick    chan struct{}
	stop    chan struct{}
	done    chan struct{}
	every   time.Duration

	closeOnce sync.Once
	closeErr  error
}

// AnnotationSessions is the annotation of a principal's sessions Lease:
// JSON, each front's name to the names of its live sessions.
const AnnotationSessions = "kiln.dev/sessions"

const (
	componentFront    = "front"
	componentSessions = "sessions"
)

// DefaultFrontLeaseDuration is how long a front's Lease stands unrenewed:
// this long after a front dies, its sessions stop counting.
const DefaultFrontLeaseDuration = 15 * time.Second

// ledgerQPS is the ledger client's rate of requests to the API server.
const ledgerQPS = 100

// ledgerAttempts bounds the writes of one claim that lose a race.
const ledgerAttempts = 16

// LedgerOptions say where the fronts share their counts.
type LedgerOptions struct {
	// Kubeconfig is the client configuration's file (default: in-cluster,
	// else $KUBECONFIG or ~/.kube/config).
	Kubeconfig string
	// Namespace holds the Leases (default: kiln's own in a cluster, else
	// default). Every front of the cluster names the same one.
	Namespace string
	// Front is this front's name, unique among the running fronts
	// (default: the host's name and a random suffix).
	Front string
	// Duration is how long the front's Lease stands unrenewed
	// (DefaultFrontLeaseDuration).
	Duration time.Duration
	Logger   *slog.Logger
}

// NewSessionLedger takes this front's Lease and returns its ledger.
func NewSessionLedger(ctx context.Context, o LedgerOptions) (*SessionLedger, error) {
	cfg, err := restConfig(o.Kubeconfig)
	if err != nil {
		return nil, err
	}
	// Each new session costs a claim of three requests, and a session
	// that ends one more write: client-go's default of 5 a second would
	// cap a front at two new sessions a second.
	cfg.QPS, cfg.Burst = ledgerQPS, 2*ledgerQPS
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return newSessionLedger(ctx, cs, o)
}

func newSessionLedger(ctx context.Context, cs kubernetes.Interface, o LedgerOptions) (*SessionLedger, error) {
	var err error
	if o.Duration, o.Namespace, o.Logger, err = leaseDefaults("front", o.Duration, DefaultFrontLeaseDuration, o.Namespace, o.Logger); err != nil {
		return nil, err
	}
	if o.Front == "" {
		o.Front = defaultFrontName()
	}
	if errs := validation.IsDNS1123Subdomain(frontLeaseName(o.Front)); errs != nil {
		return nil, fmt.Errorf("front name %q: not a name for a Lease: %s", o.Front, strings.Join(errs, "; "))
	}
	take := func(ctx context.Context) (*coordv1.Lease, error) { return takeFrontLease(ctx, cs, o) }
	l, err := take(ctx)
	if err != nil {
		return nil, err
	}
	g := &SessionLedger{
		cs: cs, ns: o.Namespace, front: o.Front, log: o.Logger,
		live:    func(string) []string { return nil },
		written: map[string][]string{},
		dirty:   map[string]bool{},
		kick:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
		every:   o.Duration / 3,
	}
	g.hold = holdLease(cs, l, o.Duration, "this front's", take, g.lapsed, o.Logger)
	go g.run()
	o.Logger.Info("counting sessions across the cluster's fronts", "lease", l.Name, "namespace", o.Namespace)
	return g, nil
}

func frontLeaseName(front string) string { return "kiln-front-" + front }

// sessionsLeaseName names a principal's Lease by a hash: a principal is
// any string (an OIDC subject, a token's name).
func sessionsLeaseName(principal string) string {
	h := sha256.Sum256([]byte(principal))
	return "kiln-sessions-" + hex.EncodeToString(h[:16])
}

// defaultFrontName is the host's name, as a Lease's name may hold it, and
// a random suffix: two fronts on one host, or a front's next run, are
// distinct fronts.
func defaultFrontName() string {
	host, _ := os.Hostname()
	host = strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			return r
		case r >= 'A' && r <= 'Z':
			return r - 'A' + 'a'
		}
		return '-'
	}, host)
	host = strings.Trim(host[:min(len(host), 40)], "-")
	suffix := rand.Text()[:8]
	if host == "" {
		return strings.ToLower(suffix)
	}
	return host + "-" + strings.ToLower(suffix)
}

func takeFrontLease(ctx context.Context, cs kubernetes.Interface, o LedgerOptions) (*coordv1.Lease, error) {
	now := metav1.NewMicroTime(time.Now())
	secs := int32(o.Duration / time.Second)
	l := &coordv1.Lease{
		ObjectMeta: metav1.ObjectMeta{
			Name: frontLeaseName(o.Front), Namespace: o.Namespace,
			Labels: map[string]string{LabelManagedBy: ManagedBy, LabelComponent: componentFront},
		},
		Spec: coordv1.LeaseSpec{HolderIdentity: &o.Front, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now},
	}
	leases := cs.CoordinationV1().Leases(o.Namespace)
	got, err := leases.Create(ctx, l, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		old, gerr := leases.Get(ctx, l.Name, metav1.GetOptions{})
		if gerr != nil {
			return nil, fmt.Errorf("reading front Lease %s: %w", l.Name, gerr)
		}
		if leaseHeld(old, time.Now()) {
			return nil, fmt.Errorf("taking front Lease %s: a live front holds it (pass another name)", l.Name)
		}
		l.ResourceVersion = old.ResourceVersion
		got, err = leases.Update(ctx, l, metav1.UpdateOptions{})
	}
	if err != nil {
		return nil, fmt.Errorf("taking front Lease %s: %w", l.Name, err)
	}
	return got, nil
}

// Bind is session.Ledger's.
func (g *SessionLedger) Bind(live func(principal string) []string) {
	g.mu.Lock()
	g.live = live
	g.mu.Unlock()
}

// Claim is session.Ledger's.
func (g *SessionLedger) Claim(ctx context.Context, principal string, limit int) (admitted bool, held int, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.write(ctx, principal, limit)
}

// Sync is session.Ledger's.
func (g *SessionLedger) Sync(principal string) {
	g.dirtyMu.Lock()
	g.dirty[principal] = true
	g.dirtyMu.Unlock()
	select {
	case g.kick <- struct{}{}:
	default:
	}
}

// lapsed: this front's Lease was renewed late, and other fronts may have
// dropped its names meanwhile; all of them are written again.
func (g *SessionLedger) lapsed() {
	g.mu.Lock()
	principals := slices.Collect(maps.Keys(g.written))
	g.mu.Unlock()
	for _, p := range principals {
		g.Sync(p)
	}
}

// run writes what Sync marked, and every third of the Lease's duration
// whatever changed since it was last written: a change no Sync told of
// is counted within that.
func (g *SessionLedger) run() {
	defer close(g.done)
	t := time.NewTicker(g.every)
	defer t.Stop()
	for {
		var sweep bool
		select {
		case <-g.stop:
			return
		case <-g.kick:
		case <-t.C:
			sweep = true
		}
		g.dirtyMu.Lock()
		todo := g.dirty
		g.dirty = map[string]bool{}
		g.dirtyMu.Unlock()
		g.mu.Lock()
		if sweep {
			for p, names := range g.written {
				if !slices.Equal(g.live(p), names) {
					todo[p] = true
				}
			}
		}
		var failed []string
		for p := range todo {
			ctx, cancel := context.WithTimeout(context.Background(), g.every)
			if _, _, err := g.write(ctx, p, 0); err != nil {
				g.log.Warn("recording a principal's live sessions for the cluster's count", "err", err)
				failed = append(failed, p)
			}
			cancel()
		}
		g.mu.Unlock()
		g.dirtyMu.Lock()
		for _, p := range failed { // the next round tries again
			g.dirty[p] = true
		}
		g.dirtyMu.Unlock()
	}
}

// write records this front's live sessions of principal: if limit > 0,
// only when with the other live fronts' they are at most limit. Call it
// with g.mu held.
func (g *SessionLedger) write(ctx context.Context, principal string, limit int) (admitted bool, held int, err error) {
	leases := g.cs.CoordinationV1().Leases(g.ns)
	name := sessionsLeaseName(principal)
	for range ledgerAttempts {
		fronts, err := g.liveFronts(ctx)
		if err != nil {
			return false, 0, err
		}
		cur, err := leases.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			cur, err = nil, nil
		}
		if err != nil {
			return false, 0, fmt.Errorf("reading Lease %s: %w", name, err)
		}
		entries := map[string][]string{}
		if cur != nil {
			if err := json.Unmarshal([]byte(cur.Annotations[AnnotationSessions]), &entries); err != nil {
				// Only what may write Leases here could have made it: it
				// counts nothing, and this write replaces it.
				g.log.Warn("a principal's sessions Lease holds no count; it is written anew", "lease", name, "err", err)
				entries = map[string][]string{}
			}
		}
		// A session is its name: one a client took from one front to
		// another (the cluster backend adopts its box) may be listed by
		// both for a while, and counts once.
		next := map[string][]string{}
		names := map[string]bool{}
		for f, theirs := range entries {
			if f != g.front && fronts[f] {
				next[f] = theirs
				for _, n := range theirs {
					names[n] = true
				}
			}
		}
		mine := g.live(principal)
		for _, n := range mine {
			names[n] = true
		}
		if limit > 0 && len(names) > limit {
			return false, len(names) - 1, nil
		}
		if len(mine) > 0 {
			next[g.front] = mine
		}
		err = g.put(ctx, cur, name, next)
		if apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err) {
			continue // another front wrote first: count again
		}
		if err != nil {
			return false, 0, fmt.Errorf("writing Lease %s: %w", name, err)
		}
		if len(mine) > 0 {
			g.written[principal] = mine
		} else {
			delete(g.written, principal)
		}
		return true, len(names) - 1, nil
	}
	return false, 0, errors.New("the count of a principal's sessions changed under every one of " + fmt.Sprint(ledgerAttempts) + " attempts to write it")
}

// put writes a principal's count over cur (nil: there is none), guarded
// by cur's resourceVersion; an empty count deletes the Lease.
func (g *SessionLedger) put(ctx context.Context, cur *coordv1.Lease, name string, next map[string][]string) error {
	leases := g.cs.CoordinationV1().Leases(g.ns)
	if len(next) == 0 {
		if cur == nil {
			return nil
		}
		rv := cur.ResourceVersion
		err := leases.Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{ResourceVersion: &rv}})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	b, err := json.Marshal(next)
	if err != nil {
		return err
	}
	if cur == nil {
		l := &coordv1.Lease{ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: g.ns,
			Labels:      map[string]string{LabelManagedBy: ManagedBy, LabelComponent: componentSessions},
			Annotations: map[string]string{AnnotationSessions: string(b)},
		}}
		_, err = leases.Create(ctx, l, metav1.CreateOptions{})
		return err
	}
	c := cur.DeepCopy()
	if c.Annotations == nil {
		c.Annotations = map[string]string{}
	}
	c.Annotations[AnnotationSessions] = string(b)
	_, err = leases.Update(ctx, c, metav1.UpdateOptions{})
	return err
}

// liveFronts are the names of the fronts whose Leases are held; this
// front is always one.
func (g *SessionLedger) liveFronts(ctx context.Context) (map[string]bool, error) {
	sel := labels.SelectorFromSet(labels.Set{LabelManagedBy: ManagedBy, LabelComponent: componentFront})
	ls, err := g.cs.CoordinationV1().Leases(g.ns).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return nil, fmt.Errorf("listing the fronts' Leases in %s: %w", g.ns, err)
	}
	out := map[string]bool{g.front: true}
	now := time.Now()
	for i := range ls.Items {
		l := &ls.Items[i]
		if l.Spec.HolderIdentity != nil && leaseHeld(l, now) {
			out[*l.Spec.HolderIdentity] = true
		}
	}
	return out, nil
}

// Close stops recording and deletes this front's Lease: its sessions
// stop counting at once.
func (g *SessionLedger) Close() error {
	g.closeOnce.Do(func() {
		close(g.stop)
		<-g.done
		g.closeErr = g.hold.Close()
	})
	return g.closeErr
}
