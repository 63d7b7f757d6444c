package kubernetes

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"kiln/internal/sandbox"
)

// LabelSession is the hash of the key of the session a box holds
// (sandbox.Adopter): any replica finds the session's box by it.
const LabelSession = "kiln.dev/session"

var _ sandbox.Adopter = (*Backend)(nil)

// sessionLabel is the label value of a session key: a hash, so that neither
// principal nor session name is written in the cluster.
func sessionLabel(key string) string {
	h := sha256.Sum256([]byte("kiln-session\x00" + key))
	return hex.EncodeToString(h[:])[:40]
}

// Bind labels the Pod of box with the session key, so that another replica
// can adopt it. The update is guarded by the Pod's resourceVersion.
func (b *Backend) Bind(ctx context.Context, box sandbox.Sandbox, key string) error {
	b.mu.Lock()
	name, ok := b.pods[box.ID()]
	b.mu.Unlock()
	if !ok {
		return fmt.Errorf("binding box %s: not a live box of this replica", box.ID())
	}
	return b.updatePod(ctx, name, func(p *corev1.Pod) error {
		if p.Labels[LabelReplica] != b.opts.Replica {
			return errTakenOver
		}
		p.Labels[LabelSession] = sessionLabel(key)
		return nil
	})
}

var errTakenOver = errors.New("kubernetes: another replica has taken the box over")

// Adopt takes over the box that holds the session key, from whichever
// replica made it (alive or dead): it moves the Pod to this replica (label
// and ownerReference to this replica's Lease) with an update guarded by
// the Pod's resourceVersion, so that of two replicas adopting at once one
// wins and the other gets the conflict, then attaches to the agent, whose
// kernel and files are as the session left them. A replica that loses its
// box this way finds its calls unanswered, and its Close of the box does
// not delete the Pod (deleteOwnPod).
func (b *Backend) Adopt(ctx context.Context, key string) (sandbox.Sandbox, error) {
	sel := labels.SelectorFromSet(labels.Set{LabelManagedBy: ManagedBy, LabelComponent: "box", LabelSession: sessionLabel(key)})
	pods, err := b.cs.CoreV1().Pods(b.opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return nil, fmt.Errorf("finding the session's box: %w", err)
	}
	var pod *corev1.Pod
	for i := range pods.Items {
		p := &pods.Items[i]
		if p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning {
			pod = p
			break
		}
	}
	if pod == nil {
		return nil, sandbox.ErrNoBox
	}
	if via := pod.Labels[LabelEgress]; via != "" {
		if err := b.sameGateway(via); err != nil {
			return nil, fmt.Errorf("leaving the session's box to its own replica: %w", err)
		}
	}
	b.mu.Lock()
	lease := b.lease
	b.mu.Unlock()
	// The Pod's resourceVersion also moves with the kubelet's status
	// updates, so a conflict alone says nothing about other replicas:
	// updatePod tries again on the fresh Pod, and the adoption is refused
	// only when the replica label has changed since the list, which is
	// another replica having moved the box first.
	seen := pod.Labels[LabelReplica]
	err = b.updatePod(ctx, pod.Name, func(p *corev1.Pod) error {
		if p.DeletionTimestamp != nil {
			return sandbox.ErrNoBox
		}
		if now := p.Labels[LabelReplica]; now != seen && now != b.opts.Replica {
			return fmt.Errorf("another replica (%s) moved it first", now)
		}
		p.Labels[LabelReplica] = b.opts.Replica
		p.OwnerReferences = []metav1.OwnerReference{*leaseOwner(lease)}
		pod = p
		return nil
	})
	if err != nil {
		if errors.Is(err, sandbox.ErrNoBox) {
			return nil, err
		}
		return nil, fmt.Errorf("adopting the session's box: %w", err)
	}
	id := pod.Annotations[AnnotationBoxID]
	if id == "" {
		id = pod.Name
	}
	log := b.log.With("pod", pod.Name, "box", id)
	start := time.Now()
	conn, err := b.connect(ctx, pod, id, log)
	if err != nil {
		return nil, err
	}
	log.Info("adopted a session's box", "took", time.Since(start).Round(time.Millisecond))
	return conn, nil
}

// updatePod reads the Pod, lets edit change it and writes it back, guarded
// by its resourceVersion; on a conflict (the kubelet's status updates, or
// another replica) it tries again with the new version, a few times.
func (b *Backend) updatePod(ctx context.Context, name string, edit func(*corev1.Pod) error) error {
	pods := b.cs.CoreV1().Pods(b.opts.Namespace)
	for range 5 {
		p, err := pods.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("reading Pod %s: %w", name, err)
		}
		if p.Labels == nil {
			p.Labels = map[string]string{}
		}
		if err := edit(p); err != nil {
			return err
		}
		_, err = pods.Update(ctx, p, metav1.UpdateOptions{})
		if !apierrors.IsConflict(err) {
			if err != nil {
				return fmt.Errorf("updating Pod %s: %w", name, err)
			}
			return nil
		}
	}
	return fmt.Errorf("updating Pod %s: it kept changing", name)
}

// deleteOwnPod deletes a box's Pod if it is still this replica's: one that
// another replica adopted is left to it. The check and the deletion are
// one step (a delete precondition on the resourceVersion that was read).
func (b *Backend) deleteOwnPod(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pods := b.cs.CoreV1().Pods(b.opts.Namespace)
	zero := int64(0)
	for range 5 {
		p, err := pods.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading Pod %s: %w", name, err)
		}
		if p.Labels[LabelReplica] != b.opts.Replica {
			b.log.Info("leaving a box another replica adopted", "pod", name)
			return nil
		}
		rv := p.ResourceVersion
		err = pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{ResourceVersion: &rv}})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if !apierrors.IsConflict(err) {
			if err != nil {
				return fmt.Errorf("deleting Pod %s: %w", name, err)
			}
			return nil
		}
	}
	return fmt.Errorf("deleting Pod %s: it kept changing", name)
}
