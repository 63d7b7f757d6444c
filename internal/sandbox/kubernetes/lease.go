package kubernetes

import (
	"context"
	"fmt"
	"time"

	coordv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
)

// A replica's Lease is the object its boxes are owned by: deleting it lets
// the garbage collector delete them.

// leaseName is the name of a replica's Lease.
func leaseName(replica string) string { return "kiln-replica-" + replica }

// takeLease creates the replica's Lease. A Lease of the same name that is
// still held (renewed within its duration) means another live replica has
// the name, which is refused.
func takeLease(ctx context.Context, cs kubernetes.Interface, ns, replica string, d time.Duration) (*coordv1.Lease, error) {
	now := metav1.NewMicroTime(time.Now())
	secs := int32(max(d/time.Second, 1))
	l := &coordv1.Lease{
		ObjectMeta: metav1.ObjectMeta{
			Name: leaseName(replica), Namespace: ns,
			Labels: map[string]string{LabelManagedBy: ManagedBy, LabelComponent: "replica", LabelReplica: replica},
		},
		Spec: coordv1.LeaseSpec{HolderIdentity: &replica, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now},
	}
	got, err := cs.CoordinationV1().Leases(ns).Create(ctx, l, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		old, gerr := cs.CoordinationV1().Leases(ns).Get(ctx, l.Name, metav1.GetOptions{})
		if gerr != nil {
			return nil, fmt.Errorf("reading replica Lease %s: %w", l.Name, gerr)
		}
		if !leaseExpired(old, time.Now()) {
			return nil, fmt.Errorf("taking replica Lease %s: a live replica holds it (pass another --k8s-replica)", l.Name)
		}
		// A dead replica of the same name: its boxes go with its Lease.
		if err := dropLease(ctx, cs, old); err != nil {
			return nil, err
		}
		got, err = cs.CoordinationV1().Leases(ns).Create(ctx, l, metav1.CreateOptions{})
	}
	if err != nil {
		return nil, fmt.Errorf("taking replica Lease %s: %w", l.Name, err)
	}
	return got, nil
}

// renewLease moves the Lease's renew time to now. The update is guarded by
// the Lease's resourceVersion: if another replica deleted or replaced it
// (took this one for dead), the renewal fails instead of resurrecting it.
func renewLease(ctx context.Context, cs kubernetes.Interface, l *coordv1.Lease) (*coordv1.Lease, error) {
	c := l.DeepCopy()
	now := metav1.NewMicroTime(time.Now())
	c.Spec.RenewTime = &now
	got, err := cs.CoordinationV1().Leases(l.Namespace).Update(ctx, c, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("renewing replica Lease %s: %w", l.Name, err)
	}
	return got, nil
}

// dropLease deletes a replica's Lease, if it is still the one given (its
// UID), and lets the garbage collector delete what it owns, in the
// background.
func dropLease(ctx context.Context, cs kubernetes.Interface, l *coordv1.Lease) error {
	bg := metav1.DeletePropagationBackground
	uid := l.UID
	err := cs.CoordinationV1().Leases(l.Namespace).Delete(ctx, l.Name, metav1.DeleteOptions{
		PropagationPolicy: &bg,
		Preconditions:     &metav1.Preconditions{UID: &uid},
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("deleting replica Lease %s: %w", l.Name, err)
	}
	return nil
}

// leaseExpired says whether a replica's Lease went unrenewed for twice its
// duration: its replica is dead (or cut off, and then its boxes are lost to
// it anyway).
func leaseExpired(l *coordv1.Lease, now time.Time) bool {
	if l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil {
		return now.Sub(l.CreationTimestamp.Time) > 2*leaseDuration
	}
	d := time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second
	return now.Sub(l.Spec.RenewTime.Time) > 2*d
}

// deadLeases lists the replica Leases in ns that have expired.
func deadLeases(ctx context.Context, cs kubernetes.Interface, ns string, now time.Time) ([]*coordv1.Lease, error) {
	sel := labels.SelectorFromSet(labels.Set{LabelManagedBy: ManagedBy, LabelComponent: "replica"})
	ls, err := cs.CoordinationV1().Leases(ns).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return nil, err
	}
	var out []*coordv1.Lease
	for i := range ls.Items {
		if leaseExpired(&ls.Items[i], now) {
			out = append(out, &ls.Items[i])
		}
	}
	return out, nil
}

// leaseOwner is the ownerReference a box's Pod carries to its replica's
// Lease.
func leaseOwner(l *coordv1.Lease) *metav1.OwnerReference {
	f := false
	return &metav1.OwnerReference{
		APIVersion: "coordination.k8s.io/v1", Kind: "Lease", Name: l.Name, UID: l.UID,
		Controller: &f, BlockOwnerDeletion: &f,
	}
}
