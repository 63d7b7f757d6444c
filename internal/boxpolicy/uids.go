package boxpolicy

import (
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"strconv"
	"strings"
	"sync/atomic"
)

// Host uids. Every box is charged to host uids of its own, which no host
// user and no other live box has: the kernel keeps some counts per user,
// whatever the namespace or cgroup (the processes of RLIMIT_NPROC, user
// namespaces, inotify instances and watches, queued signals, POSIX message
// queue bytes), so what one box takes of them leaves every other box and
// the host's own users theirs. Each backend hands out its uids from a range
// of its own, below: the jail a whole user namespace's worth a box, in
// turn (UIDSlots); the microVM one uid a jailed VMM, in turn; Kubernetes
// one a Pod, drawn at random (UIDRange.Draw), since its replicas share the
// range and keep no common counter. (Rootless, the jail maps code to the
// user's own subordinate ids instead, one a slot.)

// UIDRange is a range of host uids, both ends included.
type UIDRange struct{ First, Last int64 }

// The ranges, far above the uids of a host's users and system services and
// above the subordinate ranges user namespaces usually get (which start
// at 100000 and take 65536 a user), and below 2^31, which some tools take
// for negative. JailUIDs and VMMUIDs share a host, so they do not
// overlap; KubernetesUIDs are the nodes'.
var (
	// JailUIDs are 4096 blocks of 65536 uids, one a jail box's user
	// namespace; the first uid of block 0 is the zygote template's.
	JailUIDs = UIDRange{1 << 30, 1<<30 + 1<<28 - 1}
	// VMMUIDs are one uid a jailed QEMU.
	VMMUIDs = UIDRange{1<<30 + 1<<28, 1<<30 + 1<<28 + 1<<16 - 1}
	// KubernetesUIDs are where a Pod's code gets its uid by default
	// (--k8s-uid-range).
	KubernetesUIDs = UIDRange{1_000_000_000, 1_999_999_999}
)

// Len is how many uids the range holds.
func (r UIDRange) Len() int64 { return r.Last - r.First + 1 }

// String is the range as ParseUIDRange takes it.
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

// MinDrawnUIDs is the smallest range ParseUIDRange accepts for drawing
// from: with fewer uids, two boxes would soon draw the same one.
const MinDrawnUIDs = 1 << 16

// ParseUIDRange reads FIRST-LAST, a range to draw uids from (Check).
func ParseUIDRange(s string) (UIDRange, error) {
	a, b, ok := strings.Cut(strings.TrimSpace(s), "-")
	first, err1 := strconv.ParseInt(a, 10, 64)
	last, err2 := strconv.ParseInt(b, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return UIDRange{}, fmt.Errorf("uid range %q: want FIRST-LAST", s)
	}
	r := UIDRange{first, last}
	return r, r.Check()
}

// Check says why r is no range to draw uids from: it starts among the
// host's system users, ends at 2^31-1 or past it, or holds fewer than
// MinDrawnUIDs.
func (r UIDRange) Check() error {
	switch {
	case r.First < 1000:
		return fmt.Errorf("uid range %s: starts among the host's system users (below 1000)", r)
	case r.Last >= 1<<31-1:
		return fmt.Errorf("uid range %s: ends at or past 2^31-1", r)
	case r.Len() < MinDrawnUIDs:
		return fmt.Errorf("uid range %s: fewer than %d uids", r, MinDrawnUIDs)
	}
	return nil
}

// ErrNoUID is Draw's error when every uid drawn was in use (a range
// nearly full of live boxes).
var ErrNoUID = errors.New("no free uid in the boxes' uid range")

// Draw picks a uid of the range at random that used does not report. Two
// drawers that do not see each other's boxes, drawing at once from a range
// of a billion, meet about once in that many boxes.
func (r UIDRange) Draw(used func(uid int64) bool) (int64, error) {
	n := big.NewInt(r.Len())
	for range 64 {
		v, err := rand.Int(rand.Reader, n)
		if err != nil {
			return 0, err
		}
		if u := r.First + v.Int64(); !used(u) {
			return u, nil
		}
	}
	return 0, ErrNoUID
}

// UIDSlots hands out the blocks of Size uids of Range in turn, from block
// Reserved on, wrapping around: a block is reused once all the others
// have been handed out since. It is safe for concurrent use.
type UIDSlots struct {
	Range    UIDRange
	Size     int64 // uids a block
	Reserved int   // blocks from 0 on that are never handed out
	n        atomic.Uint64
}

// Slots is how many blocks the range holds.
func (s *UIDSlots) Slots() int { return int(s.Range.Len() / s.Size) }

// Start makes the next block handed out the one n blocks after the first
// (a backend started at random is unlikely to reuse another's blocks).
func (s *UIDSlots) Start(n uint64) { s.n.Store(n) }

// Next is the next block: its number and its first uid.
func (s *UIDSlots) Next() (slot, first int) {
	free := uint64(s.Slots() - s.Reserved)
	slot = s.Reserved + int((s.n.Add(1)-1)%free)
	return slot, s.First(slot)
}

// First is the first uid of block slot.
func (s *UIDSlots) First(slot int) int { return int(s.Range.First + int64(slot)*s.Size) }
