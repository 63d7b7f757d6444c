// Package kubernetes is kiln's Kubernetes backend: every box is a Pod whose
// container's first process is kiln-agent, and the agent protocol runs over
// one attach to that container (its stdin and stdout) through client-go.
//
// The Pod carries the box's hardening as data (buildPod): the agent as
// root with only KILL, SETGID and SETUID, starting code as a host uid of
// the box's own (uid.go) with the box's rlimits, a read-only root filesystem, memory-backed emptyDirs with size limits as
// the workspace, /tmp and /dev/shm, no service-account token, every other
// capability dropped, no privilege escalation, kiln's syscall policy as a
// Localhost seccomp profile (SeccompProfile), and memory, CPU and
// ephemeral-storage limits from the box's sandbox.Limits. A RuntimeClass
// (gVisor's runsc where the cluster has it) adds a kernel of its own. kiln
// applies a default-deny NetworkPolicy to its boxes in its namespace; the
// cluster's network plugin must enforce it.
//
// The image is the microVM image's Debian root and agent, built and pushed
// by `kiln image build --oci`.
//
// Bookkeeping lives in the API, not in the replica: each box's Pod is
// labelled with kiln's marks and the replica that made it, and owned
// (ownerReference) by that replica's Lease, which the replica renews. When a
// replica ends, it deletes its Lease; when it dies, any other replica finds
// the Lease expired and deletes it. Either way the garbage collector
// deletes the Pods it owned. A box past its TTL (AnnotationExpires) is
// deleted by whichever replica sweeps first.
package kubernetes

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	coordv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	netv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
)

// Options configure the backend. The zero value of each field is its default.
type Options struct {
	// Image is the box image (kiln image build --oci). Required.
	Image string
	// Namespace boxes are made in. Default: the namespace kiln runs in
	// (in a cluster), else "default".
	Namespace string
	// Kubeconfig is a kubeconfig file. Empty: the in-cluster config when
	// kiln runs in a Pod, else $KUBECONFIG or ~/.kube/config.
	Kubeconfig string
	// RuntimeClass names the RuntimeClass of every box ("gvisor"); empty:
	// the cluster's default runtime.
	RuntimeClass string
	// SeccompProfile is the path of SeccompProfile() on the nodes, relative
	// to the kubelet's seccomp directory ("kiln/box.json"). Empty: the
	// container runtime's default profile, which is wider than kiln's.
	SeccompProfile string
	// Replica names this kiln replica, unique among those sharing the
	// namespace. Default: the host name and a random suffix.
	Replica string
	// TTL is how long a box may live before any replica deletes it;
	// 0: no TTL (boxes live until their session ends or their replica
	// goes).
	TTL time.Duration
	// StartTimeout bounds the wait for a new Pod to run (image pull,
	// scheduling). Default 2 minutes.
	StartTimeout time.Duration
	// LeaseDuration is how long this replica's Lease stands unrenewed
	// before other replicas may take the replica for dead (after twice
	// as long) and collect its boxes. Default 30 s; whole seconds.
	LeaseDuration time.Duration
	// PullPolicy of the box image. Default IfNotPresent.
	PullPolicy corev1.PullPolicy
	// NoNetworkPolicy skips applying the default-deny NetworkPolicy (for
	// operators who manage it themselves, as contrib/kubernetes does).
	NoNetworkPolicy bool
	// UIDs is the range each box's code draws its own host uid (and gid)
	// from (uid.go); the agent runs as root. Default DefaultUIDRange.
	UIDs UIDRange
	// WarmPool is how many box Pods this replica keeps running ahead of
	// demand, of the spec Warm names; any replica may take them (see
	// pool.go). 0: no pool (the --k8s-warm-pool flag's default is
	// DefaultWarmPool).
	WarmPool int
	// PoolMaxAge is how long a pool Pod waits to be taken before it is
	// replaced. Default 30 minutes.
	PoolMaxAge time.Duration
	// Egress, when set with a non-empty Policy, gives every box a network
	// through this gateway, which must listen on an address the Pods reach
	// (egress.Options.Listen); see egress.go.
	Egress *egress.Gateway
	Policy egress.Policy
	// Logger receives lifecycle events. Default: discard.
	Logger *slog.Logger

	// Client and Config, if set, are used instead of Kubeconfig (tests).
	Client kubernetes.Interface
	Config *rest.Config
}

// Sentinel errors of the package.
var (
	ErrNoImage   = errors.New("kubernetes: no box image (build and push one with kiln image build --oci, then pass --k8s-image)")
	ErrPodFailed = errors.New("kubernetes: the box's Pod did not start")
)

// Backend makes boxes as Pods.
type Backend struct {
	opts  Options
	cs    kubernetes.Interface
	cfg   *rest.Config
	log   *slog.Logger
	lease *coordv1.Lease
	pool  *warmPool

	mu     sync.Mutex
	live   map[string]*sandbox.AgentConn // by box ID
	pods   map[string]string             // box ID → Pod name
	closed bool
	stop   chan struct{}
	wg     sync.WaitGroup
}

var (
	_ sandbox.Backend = (*Backend)(nil)
	_ sandbox.Checker = (*Backend)(nil)
	_ sandbox.Noter   = (*Backend)(nil)
)

// leaseDuration is the default of Options.LeaseDuration; a Lease is
// renewed every third of its duration.
const leaseDuration = 30 * time.Second

// sweepEvery is how often a replica deletes expired boxes and the Leases of
// dead replicas.
const sweepEvery = time.Minute

// New connects to the cluster, applies the NetworkPolicy, takes this
// replica's Lease and starts renewing it.
func New(ctx context.Context, o Options) (*Backend, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	cs, cfg := o.Client, o.Config
	if cs == nil {
		cfg, err = restConfig(o.Kubeconfig)
		if err != nil {
			return nil, err
		}
		if cs, err = kubernetes.NewForConfig(cfg); err != nil {
			return nil, fmt.Errorf("making the Kubernetes client: %w", err)
		}
	}
	routeKlog(o.Logger)
	b := &Backend{opts: o, cs: cs, cfg: cfg, log: o.Logger.With("backend", "kubernetes", "replica", o.Replica),
		live: map[string]*sandbox.AgentConn{}, pods: map[string]string{}, stop: make(chan struct{}),
		pool: newWarmPool(o.WarmPool)}
	if !o.NoNetworkPolicy {
		if err := ensureNetworkPolicy(ctx, cs, o.Namespace); err != nil {
			return nil, err
		}
		if o.egressOn() {
			if err := ensureEgressPolicy(ctx, b); err != nil {
				return nil, err
			}
		}
	}
	lease, err := takeLease(ctx, cs, o.Namespace, o.Replica, o.LeaseDuration)
	if err != nil {
		return nil, err
	}
	b.lease = lease
	if err := b.ensureTrust(ctx, leaseOwner(lease)); err != nil {
		return nil, errors.Join(err, dropLease(context.WithoutCancel(ctx), cs, lease))
	}
	for _, n := range b.Notes() {
		b.log.Warn(n)
	}
	b.sweep(ctx)
	b.wg.Add(1)
	go b.keep()
	if o.WarmPool > 0 {
		b.wg.Add(1)
		go b.keepPool()
	}
	return b, nil
}

func (o Options) withDefaults() (Options, error) {
	if o.Image == "" {
		return o, ErrNoImage
	}
	if o.Namespace == "" {
		o.Namespace = inClusterNamespace()
	}
	if o.Replica == "" {
		h, _ := os.Hostname()
		o.Replica = labelValue(strings.ToLower(h)) + "-" + randomSuffix()
	}
	if v := labelValue(o.Replica); v != o.Replica || len("kiln-replica-"+v) > 253 {
		return o, fmt.Errorf("kubernetes: replica name %q is not a valid label value", o.Replica)
	}
	if o.StartTimeout <= 0 {
		o.StartTimeout = 2 * time.Minute
	}
	if o.LeaseDuration <= 0 {
		o.LeaseDuration = leaseDuration
	}
	o.LeaseDuration = max(o.LeaseDuration.Round(time.Second), time.Second)
	if o.PullPolicy == "" {
		o.PullPolicy = corev1.PullIfNotPresent
	}
	if o.UIDs == (UIDRange{}) {
		o.UIDs = DefaultUIDRange
	}
	if err := o.UIDs.Check(); err != nil {
		return o, fmt.Errorf("kubernetes: %w", err)
	}
	if o.TTL < 0 {
		return o, errors.New("kubernetes: the TTL must not be negative")
	}
	if o.WarmPool < 0 {
		return o, errors.New("kubernetes: the warm pool's size must not be negative")
	}
	if o.PoolMaxAge <= 0 {
		o.PoolMaxAge = 30 * time.Minute
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o, o.checkEgress()
}

// restConfig is the client configuration: the kubeconfig named, else the
// in-cluster one, else the default kubeconfig.
func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		if c, err := rest.InClusterConfig(); err == nil {
			return c, nil
		}
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	if kubeconfig != "" {
		rules.ExplicitPath = kubeconfig
	}
	c, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, nil).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("loading the Kubernetes client configuration: %w", err)
	}
	return c, nil
}

// inClusterNamespace is the namespace of the Pod kiln runs in, else
// "default".
func inClusterNamespace() string {
	if b, err := os.ReadFile("/var/run/secrets/kubernetes.io/serviceaccount/namespace"); err == nil {
		if ns := strings.TrimSpace(string(b)); ns != "" {
			return ns
		}
	}
	return "default"
}

func randomSuffix() string {
	b := make([]byte, 4)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// Name is the --backend value.
func (b *Backend) Name() string { return "kubernetes" }

// Create takes a ready Pod of the box's shape from the warm pool, or else
// makes the box's Pod and waits for it to run; then it attaches to its
// agent and waits for the agent's hello. On any failure the Pod is
// deleted.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, sandbox.ErrClosed
	}
	c := b.podConfig(spec)
	if box, ok := b.createFromPool(ctx, c); ok {
		return box, nil
	}
	c, err := b.withOwnUID(ctx, c)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	pod, err := b.cs.CoreV1().Pods(c.Namespace).Create(ctx, buildPod(c), metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("creating the box's Pod: %w", err)
	}
	name := pod.Name
	log := b.log.With("pod", name, "box", spec.ID)
	destroy := func() error { return b.deletePod(name) }
	ok := false
	defer func() {
		if !ok {
			if err := destroy(); err != nil {
				log.Warn("deleting a Pod that did not start", "err", err)
			}
		}
	}()
	wctx, cancel := context.WithTimeout(ctx, b.opts.StartTimeout)
	defer cancel()
	pod, err = waitRunning(wctx, b.cs, pod)
	if err != nil {
		return nil, err
	}
	log.Debug("pod running", "took", time.Since(start).Round(time.Millisecond))
	conn, err := b.connect(ctx, pod, spec.ID, log)
	if err != nil {
		return nil, err
	}
	ok = true
	log.Info("box ready", "took", time.Since(start).Round(time.Millisecond))
	return conn, nil
}

// connect attaches to a running box's agent, begins this replica's turn on
// its stream and waits for its hello. Closing the box deletes its Pod,
// unless another replica has taken it over since.
func (b *Backend) connect(ctx context.Context, pod *corev1.Pod, id string, log *slog.Logger) (sandbox.Sandbox, error) {
	stream, err := attach(b.cs, b.cfg, pod, log)
	if err != nil {
		return nil, fmt.Errorf("attaching to the box: %w", err)
	}
	// The agent says hello only when a host's marker arrives
	// (-await-host): an attach sees only what is written after it.
	rw, err := greet(ctx, stream)
	if err != nil {
		return nil, err
	}
	name := pod.Name
	conn, err := sandbox.DialAgent(ctx, id, rw, func() error {
		b.forget(id)
		return b.deleteOwnPod(name)
	}, &sandbox.AgentConnOptions{Logger: log})
	if err != nil {
		return nil, fmt.Errorf("starting the box's agent: %w", err)
	}
	b.mu.Lock()
	b.live[id] = conn
	b.pods[id] = name
	b.mu.Unlock()
	box, err := b.withEgress(conn, pod, log)
	if err != nil {
		conn.Close()
		return nil, err
	}
	return box, nil
}

func (b *Backend) forget(id string) {
	b.mu.Lock()
	delete(b.live, id)
	delete(b.pods, id)
	b.mu.Unlock()
}

// deletePod deletes a box's Pod at once (no grace period), on a context of
// its own: teardown outlives the call that asked for it.
func (b *Backend) deletePod(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	zero := int64(0)
	err := b.cs.CoreV1().Pods(b.opts.Namespace).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("deleting Pod %s: %w", name, err)
	}
	return nil
}

// waitRunning waits until pod's container runs, or fails with why it
// cannot (an image that does not pull, a container that does not start).
func waitRunning(ctx context.Context, cs kubernetes.Interface, pod *corev1.Pod) (*corev1.Pod, error) {
	pods := cs.CoreV1().Pods(pod.Namespace)
	for {
		if done, err := podStarted(pod); done || err != nil {
			return pod, err
		}
		w, err := pods.Watch(ctx, metav1.ListOptions{
			FieldSelector:   fields.OneTermEqualSelector("metadata.name", pod.Name).String(),
			ResourceVersion: pod.ResourceVersion,
		})
		if err != nil {
			return nil, fmt.Errorf("watching the box's Pod: %w", err)
		}
		for ev := range w.ResultChan() {
			p, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			pod = p
			if done, err := podStarted(pod); done || err != nil {
				w.Stop()
				return pod, err
			}
		}
		w.Stop()
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("waiting for the box's Pod to run (%s): %w", podState(pod), err)
		}
		// The watch ended early (a timeout of the API server): read
		// the Pod again and watch from there.
		if pod, err = pods.Get(ctx, pod.Name, metav1.GetOptions{}); err != nil {
			return nil, fmt.Errorf("reading the box's Pod: %w", err)
		}
	}
}

// podStarted says whether pod's container runs, or why it never will.
func podStarted(pod *corev1.Pod) (bool, error) {
	switch pod.Status.Phase {
	case corev1.PodFailed, corev1.PodSucceeded:
		return false, fmt.Errorf("%w: %s", ErrPodFailed, podState(pod))
	}
	for _, st := range pod.Status.ContainerStatuses {
		if st.Name != ContainerName {
			continue
		}
		switch {
		case st.State.Running != nil:
			return true, nil
		case st.State.Terminated != nil:
			return false, fmt.Errorf("%w: %s", ErrPodFailed, podState(pod))
		case st.State.Waiting != nil:
			switch st.State.Waiting.Reason {
			case "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
				"CreateContainerError", "RunContainerError", "CrashLoopBackOff":
				return false, fmt.Errorf("%w: %s", ErrPodFailed, podState(pod))
			}
		}
	}
	return false, nil
}

// podState is what a Pod's status says, in a few words.
func podState(pod *corev1.Pod) string {
	s := string(pod.Status.Phase)
	if s == "" {
		s = "Pending"
	}
	if pod.Status.Reason != "" {
		s += " " + pod.Status.Reason
	}
	for _, st := range pod.Status.ContainerStatuses {
		switch {
		case st.State.Waiting != nil:
			s += fmt.Sprintf(", container waiting: %s %s", st.State.Waiting.Reason, st.State.Waiting.Message)
		case st.State.Terminated != nil:
			s += fmt.Sprintf(", container exited %d: %s %s", st.State.Terminated.ExitCode, st.State.Terminated.Reason, st.State.Terminated.Message)
		}
	}
	for _, c := range pod.Status.Conditions {
		if c.Status != corev1.ConditionTrue && c.Message != "" {
			s += fmt.Sprintf(", %s: %s", c.Type, c.Message)
		}
	}
	if len(s) > 1024 {
		s = s[:1024] + "…"
	}
	return s
}

// Check starts a box, runs a command in it and destroys it.
func (b *Backend) Check(ctx context.Context) error {
	box, err := b.Create(ctx, sandbox.Spec{ID: "check-" + randomSuffix()})
	if err != nil {
		return err
	}
	defer box.Close()
	return sandbox.Probe(ctx, box)
}

// Close destroys the live boxes, stops renewing the Lease and deletes it;
// the garbage collector deletes any Pod it still owns.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	boxes := make([]*sandbox.AgentConn, 0, len(b.live))
	for _, c := range b.live {
		boxes = append(boxes, c)
	}
	b.mu.Unlock()
	close(b.stop)
	b.wg.Wait()
	var errs []error
	for _, c := range boxes {
		errs = append(errs, c.Close())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b.drainPool(ctx)
	errs = append(errs, dropLease(ctx, b.cs, b.lease))
	return errors.Join(errs...)
}

// keep renews the Lease and sweeps until Close.
func (b *Backend) keep() {
	defer b.wg.Done()
	every := b.opts.LeaseDuration / 3
	renew := time.NewTicker(every)
	defer renew.Stop()
	// A short Lease (seconds) is swept as often, so that a dead replica's
	// boxes go soon after it is taken for dead.
	sweep := time.NewTicker(min(sweepEvery, b.opts.LeaseDuration))
	defer sweep.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-renew.C:
			ctx, cancel := context.WithTimeout(context.Background(), every)
			l, err := renewLease(ctx, b.cs, b.lease)
			cancel()
			if err != nil {
				b.log.Warn("renewing the replica's Lease", "err", err)
				continue
			}
			b.mu.Lock()
			b.lease = l
			b.mu.Unlock()
		case <-sweep.C:
			ctx, cancel := context.WithTimeout(context.Background(), sweepEvery)
			b.sweep(ctx)
			cancel()
		}
	}
}

// sweep deletes the Leases of dead replicas (the garbage collector then
// deletes their boxes) and the boxes past their TTL.
func (b *Backend) sweep(ctx context.Context) {
	now := time.Now()
	dead, err := deadLeases(ctx, b.cs, b.opts.Namespace, now)
	if err != nil {
		b.log.Warn("listing replica Leases", "err", err)
	}
	for _, l := range dead {
		b.log.Info("collecting the boxes of a dead replica", "lease", l.Name)
		if err := dropLease(ctx, b.cs, l); err != nil {
			b.log.Warn("deleting a dead replica's Lease", "lease", l.Name, "err", err)
		}
	}
	pods, err := b.cs.CoreV1().Pods(b.opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: boxSelector().String()})
	if err != nil {
		b.log.Warn("listing boxes", "err", err)
		return
	}
	for i := range pods.Items {
		p := &pods.Items[i]
		if expired(p, now) {
			b.log.Info("deleting a box past its TTL", "pod", p.Name)
			if err := b.deletePod(p.Name); err != nil {
				b.log.Warn("deleting a box past its TTL", "pod", p.Name, "err", err)
			}
		}
	}
}

// boxSelector selects every box kiln made.
func boxSelector() labels.Selector {
	return labels.SelectorFromSet(labels.Set{LabelManagedBy: ManagedBy, LabelComponent: "box"})
}

// expired says whether a box's TTL has passed. A box whose annotation does
// not parse is left alone: it may be another version's.
func expired(p *corev1.Pod, now time.Time) bool {
	s, ok := p.Annotations[AnnotationExpires]
	if !ok {
		return false
	}
	t, err := time.Parse(time.RFC3339, s)
	return err == nil && now.After(t)
}

// ensureNetworkPolicy applies the default-deny NetworkPolicy of kiln's
// boxes in ns, unless it is there already.
func ensureNetworkPolicy(ctx context.Context, cs kubernetes.Interface, ns string) error {
	_, err := cs.NetworkingV1().NetworkPolicies(ns).Create(ctx, DenyAll(ns), metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("applying the boxes' NetworkPolicy: %w", err)
	}
	return nil
}

// DenyAll is the NetworkPolicy that gives kiln's boxes in ns no traffic in
// or out.
func DenyAll(ns string) *netv1.NetworkPolicy {
	return &netv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "kiln-boxes-deny-all", Namespace: ns, Labels: map[string]string{LabelManagedBy: ManagedBy}},
		Spec: netv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{LabelManagedBy: ManagedBy, LabelComponent: "box"}},
			PolicyTypes: []netv1.PolicyType{netv1.PolicyTypeIngress, netv1.PolicyTypeEgress},
		},
	}
}

// abandon stops renewing the Lease and forgets the live boxes without
// deleting anything, as a replica that was killed would (tests).
func (b *Backend) abandon() {
	b.mu.Lock()
	b.closed = true
	b.live, b.pods = map[string]*sandbox.AgentConn{}, map[string]string{}
	b.mu.Unlock()
	close(b.stop)
	b.wg.Wait()
}

// Notes are the backend's known gaps, for kiln doctor and the log at start
// (docs/backends/kubernetes.md).
func (b *Backend) Notes() []string {
	notes := []string{
		"the kubernetes backend is new: a Pod has no pids limit of its own (code's RLIMIT_NPROC bounds its processes; set the kubelet's podPidsLimit as the node's backstop), memory-backed volumes have no inode cap (a fill ends when the box's memory does, and the OOM killer takes code first), the agent runs as root with KILL, SETGID and SETUID (Pod Security baseline, not restricted), and the default-deny NetworkPolicy holds only where the cluster enforces NetworkPolicy (a network plugin that does, or an enforcer such as kube-router's firewall; the bridge CNI alone enforces none)",
	}
	if b.opts.RuntimeClass == "" {
		notes = append(notes, "no --k8s-runtime-class: boxes run under the cluster's default runtime (runc), whose boundary is the host kernel's; use gvisor where the nodes have it")
	}
	return notes
}
