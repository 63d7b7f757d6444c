package kubernetes

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"time"

	coordv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
)

// A kiln node (internal/sandbox/cluster) registers itself in the cluster's
// API as a Lease, kiln-node-<name>, labelled as a node's and annotated with
// the address its fronts reach it at. It renews the Lease while it serves
// and deletes it when it stops. A front lists the Leases of its namespace
// and places boxes on the nodes whose Leases are held: renewed within
// their duration. A node that dies stops renewing, and within the Lease's
// duration no front places a box on it.

// AnnotationNodeAddress is the annotation of a node's Lease that holds its
// address, host:port.
const AnnotationNodeAddress = "kiln.dev/node-address"

// componentNode is the LabelComponent of a node's Lease.
const componentNode = "node"

// DefaultNodeLeaseDuration is how long a node's Lease stands unrenewed.
const DefaultNodeLeaseDuration = 15 * time.Second

func nodeLeaseName(node string) string { return "kiln-node-" + node }

// NodeRegistration is a node's Lease, renewed until Close.
type NodeRegistration struct{ *heldLease }

// RegisterOptions say how a node registers.
type RegisterOptions struct {
	// Kubeconfig is the client configuration's file (default: in-cluster,
	// else $KUBECONFIG or ~/.kube/config).
	Kubeconfig string
	// Namespace holds the Lease (default: kiln's own in a cluster, else
	// default).
	Namespace string
	// Node is the node's name, unique in the namespace (a DaemonSet's Pod
	// name).
	Node string
	// Address is where fronts reach the node, host:port.
	Address string
	// Duration is how long the Lease stands unrenewed
	// (DefaultNodeLeaseDuration).
	Duration time.Duration
	Logger   *slog.Logger
}

// RegisterNode creates the node's Lease and renews it until Close. A held
// Lease of the same name with another address is another live node's, and
// is refused; one with the same address is this node's own, left by its
// last run (a restarted container), and is taken over.
func RegisterNode(ctx context.Context, o RegisterOptions) (*NodeRegistration, error) {
	if err := checkNodeAddress(o.Address); err != nil {
		return nil, err
	}
	if errs := validation.IsDNS1123Subdomain(nodeLeaseName(o.Node)); o.Node == "" || errs != nil {
		return nil, fmt.Errorf("node name %q: not a name for a Lease: %s", o.Node, strings.Join(errs, "; "))
	}
	var err error
	if o.Duration, o.Namespace, o.Logger, err = leaseDefaults("node", o.Duration, DefaultNodeLeaseDuration, o.Namespace, o.Logger); err != nil {
		return nil, err
	}
	cfg, err := restConfig(o.Kubeconfig)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	l, err := takeNodeLease(ctx, cs, o)
	if err != nil {
		return nil, err
	}
	r := &NodeRegistration{holdLease(cs, l, o.Duration, "this node's", func(ctx context.Context) (*coordv1.Lease, error) {
		return takeNodeLease(ctx, cs, o)
	}, nil, o.Logger)}
	o.Logger.Info("registered this node in the cluster", "lease", l.Name, "namespace", o.Namespace, "address", o.Address)
	return r, nil
}

// checkNodeAddress refuses an address a front cannot dial: no port, or an
// unspecified host (0.0.0.0, ::, empty).
func checkNodeAddress(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("node address %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return fmt.Errorf("node address %q: fronts cannot dial an unspecified host; advertise the node's own address (in a Pod, its status.podIP)", addr)
	}
	return nil
}

func takeNodeLease(ctx context.Context, cs kubernetes.Interface, o RegisterOptions) (*coordv1.Lease, error) {
	now := metav1.NewMicroTime(time.Now())
	secs := int32(max(o.Duration/time.Second, 1))
	l := &coordv1.Lease{
		ObjectMeta: metav1.ObjectMeta{
			Name: nodeLeaseName(o.Node), Namespace: o.Namespace,
			Labels:      map[string]string{LabelManagedBy: ManagedBy, LabelComponent: componentNode},
			Annotations: map[string]string{AnnotationNodeAddress: o.Address},
		},
		Spec: coordv1.LeaseSpec{HolderIdentity: &o.Node, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now},
	}
	leases := cs.CoordinationV1().Leases(o.Namespace)
	got, err := leases.Create(ctx, l, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		old, gerr := leases.Get(ctx, l.Name, metav1.GetOptions{})
		if gerr != nil {
			return nil, fmt.Errorf("reading node Lease %s: %w", l.Name, gerr)
		}
		if leaseHeld(old, time.Now()) && old.Annotations[AnnotationNodeAddress] != o.Address {
			return nil, fmt.Errorf("taking node Lease %s: a live node at %s holds it (pass another --k8s-node-name)", l.Name, old.Annotations[AnnotationNodeAddress])
		}
		l.ResourceVersion = old.ResourceVersion
		got, err = leases.Update(ctx, l, metav1.UpdateOptions{})
	}
	if err != nil {
		return nil, fmt.Errorf("taking node Lease %s: %w", l.Name, err)
	}
	return got, nil
}

// leaseHeld says whether a Lease was renewed within its duration.
func leaseHeld(l *coordv1.Lease, now time.Time) bool {
	if l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil {
		return false
	}
	return now.Sub(l.Spec.RenewTime.Time) <= time.Duration(*l.Spec.LeaseDurationSeconds)*time.Second
}

// NodeLister lists the nodes registered in one namespace.
type NodeLister struct {
	cs kubernetes.Interface
	ns string
}

// NewNodeLister returns the lister of the nodes registered in namespace
// (default: kiln's own in a cluster, else default), through the client
// configuration of kubeconfig (default: in-cluster, else $KUBECONFIG or
// ~/.kube/config).
func NewNodeLister(kubeconfig, namespace string) (*NodeLister, error) {
	if namespace == "" {
		namespace = inClusterNamespace()
	}
	cfg, err := restConfig(kubeconfig)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &NodeLister{cs: cs, ns: namespace}, nil
}

// Nodes are the addresses of the nodes whose Leases are held, in the
// order of their names. A Lease without a dialable address is passed
// over: whoever can write Leases in the namespace could have made it.
func (n *NodeLister) Nodes(ctx context.Context) ([]string, error) {
	sel := labels.SelectorFromSet(labels.Set{LabelManagedBy: ManagedBy, LabelComponent: componentNode})
	ls, err := n.cs.CoordinationV1().Leases(n.ns).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return nil, fmt.Errorf("listing the kiln nodes' Leases in %s: %w", n.ns, err)
	}
	items := ls.Items
	slices.SortFunc(items, func(a, b coordv1.Lease) int { return cmp.Compare(a.Name, b.Name) })
	now := time.Now()
	var out []string
	for i := range items {
		addr := items[i].Annotations[AnnotationNodeAddress]
		if leaseHeld(&items[i], now) && checkNodeAddress(addr) == nil && !slices.Contains(out, addr) {
			out = append(out, addr)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no kiln node is registered in namespace " + n.ns + " (kiln node --k8s-register)")
	}
	return out, nil
}
