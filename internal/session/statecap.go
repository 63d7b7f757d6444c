package session

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
)

// The cap on the state directory: every principal's snapshots and
// hibernated sessions together (Options.StateQuota, --state-quota). Each
// principal has quotas of its own (--snapshot-quota, --hibernate-quota),
// but the principals are not counted: with OIDC every subject is a new
// one. A save past the cap expires the oldest hibernated sessions of any
// principal, those only on disk first, then the last saves of live ones,
// as a principal's own hibernation quota does; snapshots, which a client
// asked for by name, are never expired, and a save that would not fit
// even with every hibernation gone is refused, expiring none.
//
// What a save will write is claimed before it is written (the size its
// box declares, sandbox.WithSnapshotBudget), so saves in flight count at
// their full size, whatever they have written so far.

// DefaultStateQuota is the default of Options.StateQuota.
const DefaultStateQuota = 16 << 30

// ErrStateQuota is a save refused because every principal's saved state
// together is at Options.StateQuota.
var ErrStateQuota = errors.New("kiln's disk space for saved state is used up")

// stateCap keeps the saved state of every principal within a cap.
type stateCap struct {
	max int64
	m   *Manager
	// mu serializes claims with the room they make; it is taken before a
	// hibernator's commit lock, never after.
	mu     sync.Mutex
	claims map[string]int64 // a save's directory being written → bytes claimed
}

// claim claims n bytes for the save being written into tmp (replacing
// what it claimed before), expiring hibernated sessions other than
// saving's to make room.
func (c *stateCap) claim(tmp string, n int64, saving key) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.claims == nil {
		c.claims = make(map[string]int64)
	}
	delete(c.claims, tmp)
	used := c.used(tmp)
	if used+n <= c.max {
		c.claims[tmp] = n
		return nil
	}
	h := c.m.hib
	var gone []hibernated
	if h != nil {
		gone = h.all(saving, c.claims, c.m.isLive)
	}
	var free int64
	for _, g := range gone {
		free += g.bytes
	}
	if used-free+n > c.max {
		return fmt.Errorf("%w: saving %d bytes would take the saved state of all of kiln's clients (snapshots and hibernated sessions) to %d of %d bytes (--state-quota); delete_snapshot one you no longer need, or retry later", ErrStateQuota, n, used+n, c.max)
	}
	for _, g := range gone {
		if used+n <= c.max {
			break
		}
		h.log.Warn("expired a hibernated session to stay within the state directory's cap", "principal", g.principal, "session", g.session, "bytes", g.bytes, "state_quota", c.max)
		h.commit.Lock()
		discard(g.dir)
		h.commit.Unlock()
		used -= g.bytes
	}
	c.claims[tmp] = n
	return nil
}

// release forgets the claim of the save into tmp: it is kept under its
// final name, or removed.
func (c *stateCap) release(tmp string) {
	c.mu.Lock()
	delete(c.claims, tmp)
	c.mu.Unlock()
}

// used is the bytes of saved state: on disk, but for the directories of
// saves in flight, whose claims count instead, and for the directory of
// the save being claimed for, tmp. Call it with mu held.
func (c *stateCap) used(tmp string) int64 {
	skip := map[string]bool{tmp: true}
	var n int64
	for dir, claimed := range c.claims {
		skip[dir] = true
		n += claimed
	}
	if root, err := c.m.snapRoot(); err == nil {
		n += treeBytes(root, skip)
	}
	if h := c.m.hib; h != nil {
		n += treeBytes(h.opts.Dir, skip)
	}
	return n
}

// hibernated is one saved session on disk.
type hibernated struct {
	principal, session string
	dir                string
	bytes              int64
	live               bool
	saved              int64 // unix ns of its newest save
}

// all lists every principal's saved sessions in the order the cap expires
// them: sessions only on disk first, then the last saves of live ones,
// oldest first in each. It leaves out the session being saved and those
// with a save in flight (writing holds a claim in their directory).
func (h *hibernator) all(saving key, inFlight map[string]int64, live func(principal, name string) bool) []hibernated {
	busy := map[string]bool{}
	for dir := range inFlight {
		busy[filepath.Dir(dir)] = true
	}
	var out []hibernated
	pents, _ := os.ReadDir(h.opts.Dir)
	for _, p := range pents {
		if !p.IsDir() {
			continue
		}
		pdir := filepath.Join(h.opts.Dir, p.Name())
		sents, _ := os.ReadDir(pdir)
		for _, s := range sents {
			sdir := filepath.Join(pdir, s.Name())
			if !s.IsDir() || !strings.HasPrefix(s.Name(), "s-") || busy[sdir] {
				continue
			}
			o, err := readOwner(sdir)
			if err != nil || (key{o.Principal, o.Session}) == saving || sdir != h.sessionDir(o.Principal, o.Session) {
				continue
			}
			snaps, _ := snapDirs(sdir)
			if len(snaps) == 0 {
				continue
			}
			out = append(out, hibernated{principal: o.Principal, session: o.Session, dir: sdir,
				bytes: dirSize(sdir), live: live(o.Principal, o.Session), saved: snaps[0].saved.UnixNano()})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].live != out[j].live {
			return !out[i].live
		}
		return out[i].saved < out[j].saved
	})
	return out
}
