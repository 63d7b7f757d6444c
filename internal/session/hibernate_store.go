package session

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"kiln/internal/sandbox"
)

// The disk side of hibernation (see hibernate.go for the layout): saving
// a box as a session's newest snapshot, finding it again for its
// principal only, the quota, the TTL, and removal that no reader sees
// half done.

// hibernator keeps hibernated sessions on disk.
type hibernator struct {
	opts HibernateOptions
	log  *slog.Logger
	// snapLimit caps one snapshot: the box's workspace and memory limits.
	snapLimit int64
	// commit serializes what changes a principal's saved sessions as a
	// whole: the final rename of a snapshot and evictions for the quota.
	commit sync.Mutex
	wg     sync.WaitGroup // checkpoints and the reaper's saves in flight
	// savers bound the reaper's saves in flight (hibernateIdle).
	savers saverSlots
	// state is the cap on every principal's saved state (nil: none).
	state *stateCap
	// stopping is set once shutdown has begun: no new checkpoint starts
	// (wg.Add must not race with the shutdown's wg.Wait).
	stopMu   sync.Mutex
	stopping bool
}

func newHibernator(opts HibernateOptions, limits sandbox.Limits, log *slog.Logger) (*hibernator, error) {
	opts.defaults()
	if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating hibernation directory: %w", err)
	}
	if err := os.Chmod(opts.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("making hibernation directory private: %w", err)
	}
	return &hibernator{opts: opts, log: log, snapLimit: sandbox.SnapshotLimitFor(limits)}, nil
}

// principalDir names a principal's directory by a hash: principals are
// names from tokens, and may hold anything.
func (h *hibernator) principalDir(principal string) string {
	sum := sha256.Sum256([]byte(principal))
	return filepath.Join(h.opts.Dir, hex.EncodeToString(sum[:16]))
}

// sessionDir is the session's directory. Session names are ValidName
// ("..", "." included), hence the prefix.
func (h *hibernator) sessionDir(principal, name string) string {
	return filepath.Join(h.principalDir(principal), "s-"+name)
}

type ownerFile struct {
	Principal string `json:"principal"`
	Session   string `json:"session"`
}

const ownerName = "owner"

// writeOwner records who a session directory belongs to.
func writeOwner(dir, principal, name string) error {
	b, err := json.Marshal(ownerFile{Principal: principal, Session: name})
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, ownerName+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, ownerName))
}

// readOwner reads a session directory's owner file (bounded: it is ours,
// but a damaged disk is input too).
func readOwner(dir string) (ownerFile, error) {
	var o ownerFile
	f, err := os.Open(filepath.Join(dir, ownerName))
	if err != nil {
		return o, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 64<<10))
	if err != nil {
		return o, err
	}
	if err := json.Unmarshal(b, &o); err != nil {
		return o, fmt.Errorf("reading owner file: %w", err)
	}
	return o, nil
}

// snapDirs lists the complete snapshots in a session directory, newest
// first, with the time each was taken (from its name, which kiln wrote).
func snapDirs(dir string) ([]savedSnap, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []savedSnap
	for _, e := range ents {
		ns, ok := strings.CutPrefix(e.Name(), "snap-")
		if !ok || !e.IsDir() || strings.HasSuffix(ns, ".tmp") {
			continue
		}
		n, err := strconv.ParseInt(ns, 10, 64)
		if err != nil {
			continue
		}
		out = append(out, savedSnap{dir: filepath.Join(dir, e.Name()), saved: time.Unix(0, n)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].saved.After(out[j].saved) })
	return out, nil
}

type savedSnap struct {
	dir   string
	saved time.Time
}

// latest returns the newest snapshot of the principal's session, after
// checking that the session directory is theirs. fs.ErrNotExist: none.
func (h *hibernator) latest(principal, name string) (savedSnap, error) {
	dir := h.sessionDir(principal, name)
	if _, err := os.Lstat(dir); err != nil {
		return savedSnap{}, err
	}
	o, err := readOwner(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return savedSnap{}, fmt.Errorf("%w: it has no owner file", errNotOwner)
	}
	if err != nil {
		return savedSnap{}, err
	}
	if o.Principal != principal || o.Session != name {
		return savedSnap{}, errNotOwner
	}
	snaps, err := snapDirs(dir)
	if err != nil {
		return savedSnap{}, err
	}
	if len(snaps) == 0 {
		return savedSnap{}, fs.ErrNotExist
	}
	return snaps[0], nil
}

// save snapshots box as the principal's session called name, replacing
// its older snapshot, within the principal's quota. Call it on the
// session's turn.
func (h *hibernator) save(ctx context.Context, principal, name string, box sandbox.Sandbox, live func(principal, name string) bool) (*sandbox.SnapshotInfo, error) {
	sn, ok := inner(box).(sandbox.Snapshotter)
	if !ok {
		return nil, ErrNoSnapshotBoxes
	}
	dir := h.sessionDir(principal, name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating session directory: %w", err)
	}
	if o, err := readOwner(dir); err != nil || o.Principal != principal || o.Session != name {
		if err := writeOwner(dir, principal, name); err != nil {
			return nil, fmt.Errorf("writing owner file: %w", err)
		}
	}
	taken := time.Now()
	tmp := filepath.Join(dir, fmt.Sprintf("snap-%d.tmp", taken.UnixNano()))
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return nil, fmt.Errorf("creating snapshot directory: %w", err)
	}
	// A save larger than the whole quota is refused before any of it is
	// written; makeRoom makes room for the rest once it is.
	claim := func(n int64) error {
		if n > h.opts.Quota {
			return fmt.Errorf("%w: %d bytes, quota %d bytes per principal (--hibernate-quota)", ErrHibernateQuota, n, h.opts.Quota)
		}
		if h.state != nil {
			return h.state.claim(tmp, n, key{principal, name})
		}
		return nil
	}
	if h.state != nil {
		defer h.state.release(tmp) // after the commit below
	}
	ctx = sandbox.WithSnapshotBudget(sandbox.WithSnapshotLimit(ctx, h.snapLimit), claim)
	info, err := sn.Snapshot(ctx, tmp)
	if err != nil {
		os.RemoveAll(tmp)
		return nil, fmt.Errorf("snapshotting sandbox: %w", err)
	}
	size := dirSize(tmp)
	if err := claim(size); err != nil { // what is kept, the manifest with it
		os.RemoveAll(tmp)
		return nil, err
	}
	h.commit.Lock()
	defer h.commit.Unlock()
	if err := h.makeRoom(principal, name, size, live); err != nil {
		os.RemoveAll(tmp)
		return nil, err
	}
	if err := os.Rename(tmp, strings.TrimSuffix(tmp, ".tmp")); err != nil {
		os.RemoveAll(tmp)
		return nil, fmt.Errorf("keeping snapshot: %w", err)
	}
	snaps, _ := snapDirs(dir)
	for _, old := range snaps[min(1, len(snaps)):] {
		discard(old.dir)
	}
	if info == nil {
		info = &sandbox.SnapshotInfo{}
	}
	info.Bytes = size
	return info, nil
}

// makeRoom expires the principal's oldest saved sessions, other than
// name, until size more bytes fit in the quota: sessions that are only on
// disk first, then the checkpoints of live ones. Hibernation happens
// without anyone asking for it, so the session least likely to be wanted
// again gives way, not the one being saved. Call it with commit held.
func (h *hibernator) makeRoom(principal, name string, size int64, live func(principal, name string) bool) error {
	if size > h.opts.Quota {
		return fmt.Errorf("%w: %d bytes, quota %d bytes per principal (--hibernate-quota)", ErrHibernateQuota, size, h.opts.Quota)
	}
	var total int64
	var others []SessionInfo
	for _, si := range h.list(principal) {
		if si.Name == name {
			continue
		}
		total += si.Bytes
		others = append(others, si)
	}
	sort.SliceStable(others, func(i, j int) bool {
		li, lj := live(principal, others[i].Name), live(principal, others[j].Name)
		if li != lj {
			return !li
		}
		return others[i].Saved.Before(others[j].Saved)
	})
	for _, o := range others {
		if total+size <= h.opts.Quota {
			break
		}
		h.log.Warn("expired a hibernated session to stay within the principal's quota", "principal", principal, "session", o.Name, "bytes", o.Bytes, "quota", h.opts.Quota)
		discard(h.sessionDir(principal, o.Name))
		total -= o.Bytes
	}
	return nil
}

// remove forgets a saved session; true if there was one.
func (h *hibernator) remove(principal, name string) bool {
	dir := h.sessionDir(principal, name)
	if _, err := os.Lstat(dir); err != nil {
		return false
	}
	h.commit.Lock()
	defer h.commit.Unlock()
	discard(dir)
	return true
}

// list returns the principal's saved sessions, by name.
func (h *hibernator) list(principal string) []SessionInfo {
	ents, err := os.ReadDir(h.principalDir(principal))
	if err != nil {
		return nil
	}
	var out []SessionInfo
	for _, e := range ents {
		name, ok := strings.CutPrefix(e.Name(), "s-")
		if !ok || !e.IsDir() || !ValidName(name) {
			continue
		}
		snap, err := h.latest(principal, name)
		if err != nil {
			continue
		}
		out = append(out, SessionInfo{Name: name, State: StateHibernated, Saved: snap.saved,
			Bytes: dirSize(filepath.Join(h.principalDir(principal), e.Name()))})
	}
	return out
}

// expire removes saved sessions older than the TTL that are not live, and
// snapshots left half-written by a crash.
func (h *hibernator) expire(live func(principal, name string) bool) {
	pents, err := os.ReadDir(h.opts.Dir)
	if err != nil {
		return
	}
	now := time.Now()
	for _, p := range pents {
		if !p.IsDir() {
			continue
		}
		pdir := filepath.Join(h.opts.Dir, p.Name())
		sents, _ := os.ReadDir(pdir)
		for _, s := range sents {
			sdir := filepath.Join(pdir, s.Name())
			if strings.HasPrefix(s.Name(), gonePrefix) { // a discard cut short
				os.RemoveAll(sdir)
				continue
			}
			h.sweepTmp(sdir, now)
			o, err := readOwner(sdir)
			if err != nil {
				continue // being created, or damaged: restore reports it
			}
			snaps, _ := snapDirs(sdir)
			if live(o.Principal, o.Session) {
				continue
			}
			if len(snaps) == 0 || now.Sub(snaps[0].saved) > h.opts.TTL {
				h.commit.Lock()
				discard(sdir)
				h.commit.Unlock()
				if len(snaps) > 0 {
					h.log.Info("hibernated session expired", "principal", o.Principal, "session", o.Session, "saved", snaps[0].saved)
				}
			}
		}
	}
}

const gonePrefix = ".gone-"

// discard removes a directory so that no reader sees it half removed: it
// is renamed out of the way first, then removed.
func discard(dir string) {
	gone := filepath.Join(filepath.Dir(dir), gonePrefix+newID())
	if os.Rename(dir, gone) == nil {
		dir = gone
	}
	os.RemoveAll(dir)
}

// sweepTmp removes snapshots that have been half-written for an hour:
// a save interrupted by a crash.
func (h *hibernator) sweepTmp(sdir string, now time.Time) {
	ents, _ := os.ReadDir(sdir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), gonePrefix) {
			os.RemoveAll(filepath.Join(sdir, e.Name()))
			continue
		}
		if !strings.HasSuffix(e.Name(), ".tmp") {
			continue
		}
		if fi, err := e.Info(); err == nil && now.Sub(fi.ModTime()) > time.Hour {
			os.RemoveAll(filepath.Join(sdir, e.Name()))
		}
	}
}

// dirSize is the bytes of the regular files under dir.
func dirSize(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}
