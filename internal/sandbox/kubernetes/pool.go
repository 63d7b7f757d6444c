package kubernetes

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"

	"kiln/internal/sandbox"
)

// The warm pool. Each replica keeps Options.WarmPool box Pods running
// ahead of demand, made from the spec the server will ask for (Warm). A
// pool Pod is an ordinary box Pod (same hardening, same NetworkPolicy,
// owned by its replica's Lease, so a dead replica's pool is collected with
// its boxes) that carries LabelPool, the hash of its shape: everything of
// its Pod spec that a box spec decides. Its agent has started and
// preloaded, and waits for a host (-await-host).
//
// Any replica may take any pool Pod of the shape it needs: Create lists
// them and takes the oldest ready one by an update, guarded by the
// resourceVersion it read, that removes LabelPool and moves the Pod to
// itself (label and ownerReference), as Adopt moves a session's box. Of
// two replicas taking the same Pod at once, one wins and the other gets a
// Conflict and tries the next. The owner then refills in the background.
// A pool Pod that never runs within StartTimeout, fails, or outlives
// PoolMaxAge is deleted by its replica, with a precondition on the version
// it read, so a Pod taken meanwhile is left alone.
//
// Per-call mode's fresh box per call is the session layer's Create, so a
// per-call run takes a pool Pod and its Close deletes it.

// LabelPool marks a ready-to-take pool Pod; its value is the Pod's shape
// (shapeOf). Taking the Pod removes it.
const LabelPool = "kiln.dev/pool"

// annotationPoolExpires is when a pool Pod nobody took is replaced (RFC
// 3339); taking the Pod removes it.
const annotationPoolExpires = "kiln.dev/pool-expires"

// DefaultWarmPool is --k8s-warm-pool's default.
const DefaultWarmPool = 2

// poolCheckEvery is how often a replica looks over its pool without being
// asked (a take or a Pod's end asks sooner).
const poolCheckEvery = 5 * time.Second

// maxPoolBackoff bounds the wait between pool Pods while they fail.
const maxPoolBackoff = 2 * time.Minute

// takeMargin: a pool Pod that expires sooner than this is not taken, so
// that its replica's deletion cannot meet a box just handed out.
const takeMargin = time.Minute

// poolPrefix starts the box ID of a pool Pod until it is taken.
const poolPrefix = "pool-"

// warmPool is a replica's pool: the shape it keeps, and a wake-up for its
// keeper.
type warmPool struct {
	size int
	kick chan struct{}
	// backoff delays new Pods after one failed or never ran (an image
	// that does not pull), until a Pod runs again; notBefore is when the
	// next may be made. Only the keeper goroutine uses them.
	backoff   time.Duration
	notBefore time.Time

	mu    sync.Mutex
	shape string        // "" until Warm names the spec
	cfg   podConfig     // the shape's Pod, less what each Pod has of its own
	ready chan struct{} // closed and replaced when the pool gains a ready Pod
}

func newWarmPool(size int) *warmPool {
	return &warmPool{size: size, kick: make(chan struct{}, 1), ready: make(chan struct{})}
}

func (p *warmPool) wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *warmPool) current() (string, podConfig) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.shape, p.cfg
}

// shapeOf hashes what a box's Pod spec holds of its box spec and of the
// replica's options: two Pods of one shape are interchangeable until one
// is taken. What each Pod has of its own (name, box ID, replica, owner,
// TTL, and the uid its code runs as where each box draws one) is left out.
func shapeOf(c podConfig) string {
	c.Name, c.BoxID, c.Replica, c.Owner, c.Expires = "", "", "", nil, time.Time{}
	c.UID, c.GID = 0, 0
	pod := buildPod(c)
	b, err := json.Marshal(struct {
		Spec corev1.PodSpec
		Ann  map[string]string
	}{pod.Spec, pod.Annotations})
	if err != nil {
		panic(err) // a PodSpec always marshals
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])[:40]
}

// podConfig is the Pod of the box spec asks for, on this replica, less its
// uid (withOwnUID), drawn only for a Pod that is made.
func (b *Backend) podConfig(spec sandbox.Spec) podConfig {
	b.mu.Lock()
	lease := b.lease
	b.mu.Unlock()
	c := podConfig{
		Name:           podName(spec.ID, randomSuffix()),
		Namespace:      b.opts.Namespace,
		BoxID:          spec.ID,
		Image:          b.opts.Image,
		PullPolicy:     b.opts.PullPolicy,
		RuntimeClass:   b.opts.RuntimeClass,
		SeccompProfile: b.opts.SeccompProfile,
		Limits:         spec.Limits.WithDefaults(),
		Preload:        spec.Preload,
		Replica:        b.opts.Replica,
		Owner:          leaseOwner(lease),
		Net:            b.podNet(),
	}
	if b.opts.TTL > 0 {
		c.Expires = time.Now().Add(b.opts.TTL)
	}
	return c
}

var _ sandbox.Warmer = (*Backend)(nil)

// Warm names the spec of the boxes the server will ask for: the pool keeps
// Pods of its shape from now on. It returns once one is ready to take, or
// with an error if none is within StartTimeout. With no pool it returns at
// once.
func (b *Backend) Warm(ctx context.Context, spec sandbox.Spec) error {
	p := b.pool
	if p.size == 0 {
		return nil
	}
	spec.ID = ""
	c := b.podConfig(spec)
	shape := shapeOf(c)
	p.mu.Lock()
	p.shape, p.cfg = shape, c
	p.mu.Unlock()
	p.wake()
	ctx, cancel := context.WithTimeout(ctx, b.opts.StartTimeout)
	defer cancel()
	for {
		p.mu.Lock()
		ready := p.ready
		p.mu.Unlock()
		n, err := b.readyPoolPods(ctx, shape)
		if err == nil && n > 0 {
			return nil
		}
		select {
		case <-ready:
		case <-time.After(250 * time.Millisecond):
		case <-ctx.Done():
			return fmt.Errorf("waiting for a warm pool Pod: %w", ctx.Err())
		}
	}
}

// poolSelector selects the pool Pods of shape ("": of any shape), of
// replica ("": of any replica).
func poolSelector(shape, replica string) string {
	set := labels.Set{LabelManagedBy: ManagedBy, LabelComponent: "box"}
	if replica != "" {
		set[LabelReplica] = replica
	}
	sel := labels.SelectorFromSet(set)
	if shape != "" {
		r, _ := labels.NewRequirement(LabelPool, selection.Equals, []string{shape})
		return sel.Add(*r).String()
	}
	r, _ := labels.NewRequirement(LabelPool, selection.Exists, nil)
	return sel.Add(*r).String()
}

func (b *Backend) readyPoolPods(ctx context.Context, shape string) (int, error) {
	l, err := b.cs.CoreV1().Pods(b.opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: poolSelector(shape, "")})
	if err != nil {
		return 0, err
	}
	return len(takeable(l.Items, time.Now())), nil
}

// takeable are the pool Pods that may be taken now, oldest first.
func takeable(pods []corev1.Pod, now time.Time) []*corev1.Pod {
	var out []*corev1.Pod
	for i := range pods {
		p := &pods[i]
		if p.DeletionTimestamp != nil || poolExpired(p, now.Add(takeMargin)) {
			continue
		}
		if ok, err := podStarted(p); ok && err == nil {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b *corev1.Pod) int {
		if c := a.CreationTimestamp.Compare(b.CreationTimestamp.Time); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out
}

// poolExpired says whether a pool Pod is past its age at t. One whose
// annotation does not parse is taken for expired: kiln wrote it.
func poolExpired(p *corev1.Pod, t time.Time) bool {
	s, ok := p.Annotations[annotationPoolExpires]
	if !ok {
		return false
	}
	e, err := time.Parse(time.RFC3339, s)
	return err != nil || t.After(e)
}

// unconditionalTake drops the resourceVersion precondition of a take
// (tests: it shows what the precondition prevents).
var unconditionalTake = false

// take moves a ready pool Pod of c's shape to this replica as the box c
// describes, or returns nil if none could be had. Of replicas racing for
// one Pod, the update's resourceVersion precondition lets one win; the
// others try the next Pod, and list again if every one changed under
// them (the kubelet's status updates change them too).
func (b *Backend) take(ctx context.Context, c podConfig) (*corev1.Pod, error) {
	shape := shapeOf(c)
	pods := b.cs.CoreV1().Pods(b.opts.Namespace)
	for range 3 {
		l, err := pods.List(ctx, metav1.ListOptions{LabelSelector: poolSelector(shape, "")})
		if err != nil {
			return nil, fmt.Errorf("listing the warm pool: %w", err)
		}
		cands := takeable(l.Items, time.Now())
		if len(cands) == 0 {
			return nil, nil
		}
		conflicts := 0
		for _, p := range cands {
			t := p.DeepCopy()
			delete(t.Labels, LabelPool)
			delete(t.Annotations, annotationPoolExpires)
			if t.Annotations == nil {
				t.Annotations = map[string]string{}
			}
			t.Labels[LabelReplica] = labelValue(c.Replica)
			t.Labels[LabelBox] = labelValue(c.BoxID)
			t.Annotations[AnnotationBoxID] = c.BoxID
			if !c.Expires.IsZero() {
				t.Annotations[AnnotationExpires] = c.Expires.UTC().Format(time.RFC3339)
			}
			t.OwnerReferences = []metav1.OwnerReference{*c.Owner}
			if unconditionalTake {
				t.ResourceVersion = ""
			}
			got, err := pods.Update(ctx, t, metav1.UpdateOptions{})
			switch {
			case err == nil:
				return got, nil
			case apierrors.IsConflict(err), apierrors.IsNotFound(err):
				conflicts++
				continue
			default:
				return nil, fmt.Errorf("taking pool Pod %s: %w", p.Name, err)
			}
		}
		if conflicts == 0 {
			return nil, nil
		}
	}
	return nil, nil
}

// createFromPool makes the box c describes from a pool Pod, if one of its
// shape is ready: it takes the Pod, attaches to its agent and greets it.
// ok is false on a miss; a Pod taken whose agent does not answer is
// deleted and counts as a miss.
func (b *Backend) createFromPool(ctx context.Context, c podConfig) (box sandbox.Sandbox, ok bool) {
	start := time.Now()
	pod, err := b.take(ctx, c)
	if err != nil {
		b.log.Warn("taking a box from the warm pool", "err", err)
		return nil, false
	}
	if pod == nil {
		return nil, false
	}
	b.pool.wake()
	log := b.log.With("pod", pod.Name, "box", c.BoxID)
	log.Debug("took a warm pool Pod", "took", time.Since(start).Round(time.Millisecond))
	conn, err := b.connect(ctx, pod, c.BoxID, log)
	if err != nil {
		log.Warn("a warm pool Pod did not answer; making a box instead", "err", err)
		if err := b.deleteOwnPod(pod.Name); err != nil {
			log.Warn("deleting a pool Pod that did not answer", "err", err)
		}
		return nil, false
	}
	log.Info("box ready from the warm pool", "took", time.Since(start).Round(time.Millisecond))
	return conn, true
}

// keepPool keeps this replica's pool full until stop.
func (b *Backend) keepPool() {
	defer b.wg.Done()
	t := time.NewTicker(poolCheckEvery)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-b.pool.kick:
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), b.opts.StartTimeout)
		b.refill(ctx)
		cancel()
	}
}

// refill deletes this replica's pool Pods that will not serve (another
// shape, failed, never ready, too old) and makes Pods up to the pool's
// size.
func (b *Backend) refill(ctx context.Context) {
	p := b.pool
	shape, cfg := p.current()
	if shape == "" {
		return
	}
	l, err := b.cs.CoreV1().Pods(b.opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: poolSelector("", b.opts.Replica)})
	if err != nil {
		b.log.Warn("listing the warm pool", "err", err)
		return
	}
	now := time.Now()
	have, ready := 0, 0
	for i := range l.Items {
		pod := &l.Items[i]
		if pod.DeletionTimestamp != nil {
			continue
		}
		started, failed := podStarted(pod)
		why := ""
		switch {
		case pod.Labels[LabelPool] != shape:
			why = "of another shape"
		case failed != nil:
			why = failed.Error()
		case !started && now.Sub(pod.CreationTimestamp.Time) > b.opts.StartTimeout:
			why = "never ready: " + podState(pod)
		case poolExpired(pod, now.Add(takeMargin)):
			why = "past its age"
		}
		if why != "" {
			b.log.Info("replacing a warm pool Pod", "pod", pod.Name, "why", why)
			b.deleteUnchanged(ctx, pod)
			if failed != nil || !started {
				p.backoff = min(max(2*p.backoff, poolCheckEvery), maxPoolBackoff)
				p.notBefore = now.Add(p.backoff)
			}
			continue
		}
		have++
		if started {
			ready++
		}
	}
	if ready > 0 {
		p.backoff = 0
		p.mu.Lock()
		close(p.ready)
		p.ready = make(chan struct{})
		p.mu.Unlock()
	}
	if now.Before(p.notBefore) {
		return
	}
	for ; have < p.size && ctx.Err() == nil; have++ {
		c := cfg
		c.BoxID = poolPrefix + randomSuffix()
		c.Name = podName(c.BoxID, randomSuffix())
		c.Expires = time.Time{}
		b.mu.Lock()
		c.Owner = leaseOwner(b.lease)
		b.mu.Unlock()
		c, err := b.withOwnUID(ctx, c)
		if err != nil {
			b.log.Warn("making a warm pool Pod", "err", err)
			return
		}
		pod := buildPod(c)
		pod.Labels[LabelPool] = shape
		pod.Annotations[annotationPoolExpires] = now.Add(b.opts.PoolMaxAge).UTC().Format(time.RFC3339)
		if _, err := b.cs.CoreV1().Pods(b.opts.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			b.log.Warn("making a warm pool Pod", "err", err)
			return
		}
	}
}

// deleteUnchanged deletes a Pod if it is still at the version read: a pool
// Pod another replica took meanwhile is left to it.
func (b *Backend) deleteUnchanged(ctx context.Context, pod *corev1.Pod) {
	zero := int64(0)
	rv := pod.ResourceVersion
	err := b.cs.CoreV1().Pods(b.opts.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{ResourceVersion: &rv},
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		b.log.Warn("deleting a warm pool Pod", "pod", pod.Name, "err", err)
	}
}

// drainPool deletes this replica's pool Pods that nobody took (Close).
func (b *Backend) drainPool(ctx context.Context) {
	l, err := b.cs.CoreV1().Pods(b.opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: poolSelector("", b.opts.Replica)})
	if err != nil {
		b.log.Warn("listing the warm pool", "err", err)
		return
	}
	for i := range l.Items {
		b.deleteUnchanged(ctx, &l.Items[i])
	}
}

// isPoolPod says whether a Pod is an untaken pool Pod.
func isPoolPod(p *corev1.Pod) bool {
	_, ok := p.Labels[LabelPool]
	return ok
}
