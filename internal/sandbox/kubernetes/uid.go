package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"kiln/internal/boxpolicy"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Each box's code runs as a host uid (and gid) of its own, drawn at random
// (boxpolicy.UIDRange.Draw) from a range no one else uses, and labelled on
// its Pod (LabelUID): charged to a uid no other box and no host user has,
// what one box takes of the kernel's per-user counts leaves every other
// box and the host's own users theirs, and RLIMIT_NPROC bounds the box's
// processes (boxpolicy, uids.go).

// UIDRange is the range of host uids boxes' code is given, both ends
// included (--k8s-uid-range).
type UIDRange = boxpolicy.UIDRange

// DefaultUIDRange is boxpolicy.KubernetesUIDs.
var DefaultUIDRange = boxpolicy.KubernetesUIDs

// withOwnUID gives c a uid and gid of its own (pickUID): every Pod made
// must have one.
func (b *Backend) withOwnUID(ctx context.Context, c podConfig) (podConfig, error) {
	u, err := b.pickUID(ctx)
	if err != nil {
		return c, err
	}
	c.UID, c.GID = u, u
	return c, nil
}

// pickUID draws a uid for a new box from the range, avoiding those of the
// boxes this replica can see in its namespace. Two replicas drawing at
// once from a range of a billion meet about once in that many boxes.
func (b *Backend) pickUID(ctx context.Context) (int64, error) {
	// From the API server's cache: a box made a moment ago by another
	// replica may be missing, which the draw makes harmless.
	pods, err := b.cs.CoreV1().Pods(b.opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: boxSelector().String(), ResourceVersion: "0"})
	if err != nil {
		return 0, fmt.Errorf("listing the boxes' uids: %w", err)
	}
	used := map[int64]bool{}
	for _, p := range pods.Items {
		if u, err := strconv.ParseInt(p.Labels[LabelUID], 10, 64); err == nil {
			used[u] = true
		}
	}
	return drawUID(b.opts.UIDs, used)
}

func drawUID(r UIDRange, used map[int64]bool) (int64, error) {
	u, err := r.Draw(func(u int64) bool { return used[u] })
	if errors.Is(err, boxpolicy.ErrNoUID) {
		return 0, fmt.Errorf("kubernetes: %w", err)
	}
	return u, err
}
