package kubernetes

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"strconv"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Each box's code runs as a host uid (and gid) of its own, drawn at random
// from a range no one else uses, and labelled on its Pod (LabelUID). The
// kernel keeps some counts per user, whatever the namespace or cgroup: the
// processes of RLIMIT_NPROC, inotify instances and watches, queued signals
// and POSIX message queue bytes. Charged to a uid no other box and no host
// user has, what one box takes of them leaves every other box and the
// host's own users theirs, and RLIMIT_NPROC bounds the box's processes.

// UIDRange is the range of host uids boxes' code is given, both ends
// included.
type UIDRange struct{ First, Last int64 }

// DefaultUIDRange is far above the uids of a host's users and system
// services (and of the subordinate ranges user namespaces usually get,
// which start at 100000 and take 65536 a user) and below 2^31, which
// some tools take for negative.
var DefaultUIDRange = UIDRange{1_000_000_000, 1_999_999_999}

// String is the range as --k8s-uid-range takes it.
func (r UIDRange) String() string {
	return strconv.FormatInt(r.First, 10) + "-" + strconv.FormatInt(r.Last, 10)
}

// Set parses FIRST-LAST (flag.Value).
func (r *UIDRange) Set(s string) error {
	v, err := ParseUIDRange(s)
	if err != nil {
		return err
	}
	*r = v
	return nil
}

// minUIDs is the smallest range accepted: with fewer uids, two boxes
// would soon draw the same one.
const minUIDs = 1 << 16

// ParseUIDRange reads FIRST-LAST.
func ParseUIDRange(s string) (UIDRange, error) {
	a, b, ok := strings.Cut(strings.TrimSpace(s), "-")
	first, err1 := strconv.ParseInt(a, 10, 64)
	last, err2 := strconv.ParseInt(b, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return UIDRange{}, fmt.Errorf("uid range %q: want FIRST-LAST", s)
	}
	r := UIDRange{first, last}
	return r, r.check()
}

func (r UIDRange) check() error {
	switch {
	case r.First < 1000:
		return fmt.Errorf("uid range %s: starts among the host's system users (below 1000)", r)
	case r.Last >= 1<<31-1:
		return fmt.Errorf("uid range %s: ends at or past 2^31-1", r)
	case r.Last-r.First+1 < minUIDs:
		return fmt.Errorf("uid range %s: fewer than %d uids", r, minUIDs)
	}
	return nil
}

// errNoUID: every uid drawn was in use (a range nearly full of live boxes).
var errNoUID = errors.New("kubernetes: no free uid in the boxes' uid range")

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
	n := big.NewInt(r.Last - r.First + 1)
	for range 64 {
		v, err := rand.Int(rand.Reader, n)
		if err != nil {
			return 0, err
		}
		if u := r.First + v.Int64(); !used[u] {
			return u, nil
		}
	}
	return 0, errNoUID
}
