package session

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"kiln/internal/event"
	"kiln/internal/sandbox"
)

// Snapshots of sessions: fork a session, snapshot it by name and roll it
// back. They are state level (sandbox.FormatState): the workspace's files
// and the kernel's globals, saved variable by variable in the box, loaded
// into a fresh box from the pool, which enforces today's limits and is
// reseeded. Running processes, open files and sockets are not kept; what
// could not be saved is named.
//
// Snapshots live on disk, under a root only root can read (0700):
// <root>/<principal digest>/s-<session>/n-<name>/. The root is
// <state dir>/snapshots with a state directory, which keeps them across
// restarts, else a private temporary directory removed at Close. The
// directory tree is the index: there is no other record to lose.

// SnapshotOptions configure snapshots; zero values mean defaults.
type SnapshotOptions struct {
	// StateDir, if set, keeps snapshots under StateDir/snapshots across
	// restarts; else they live in a private temporary directory removed
	// at Close.
	StateDir string
	// Max caps the named snapshots one session keeps (DefaultMaxSnapshots).
	Max int
	// Quota caps the bytes of one principal's snapshots on disk
	// (DefaultSnapshotQuota).
	Quota int64
}

// Defaults of SnapshotOptions.
const (
	DefaultMaxSnapshots  = 8
	DefaultSnapshotQuota = 2 << 30
)

func (o *SnapshotOptions) defaults() {
	if o.Max <= 0 {
		o.Max = DefaultMaxSnapshots
	}
	if o.Quota <= 0 {
		o.Quota = DefaultSnapshotQuota
	}
}

// Errors of snapshots a client can act on.
var (
	ErrNoSnapshot      = errors.New("no such snapshot")
	ErrSnapshotExists  = errors.New("a session by that name already exists")
	ErrSnapshotsFull   = errors.New("the session keeps as many snapshots as it may")
	ErrSnapshotQuota   = errors.New("your snapshots take all the disk space you may use")
	ErrNoSnapshotBoxes = errors.New("snapshots are not supported")
	ErrNoSession       = errors.New("no such session")
	ErrNothingToSave   = errors.New("the session has no sandbox right now: there is nothing to save (run something in it first)")
)

// snapStore is where a Manager keeps snapshots, made on first use.
type snapStore struct {
	once    sync.Once
	root    string
	private bool
	err     error
	// locks serialize one principal's quota checks with the writes they
	// allow. They are per principal: a box that stalls its own save (a
	// __reduce__ that sleeps) holds up only its principal's snapshots.
	locks keyedMutex
	// claims are the bytes that saves in flight hold against their
	// principal's quota, by the temporary directory each writes: the
	// size its box declared, claimed before a byte is written. Changed
	// with the principal's lock held.
	claimMu sync.Mutex
	claims  map[string]snapClaim
}

type snapClaim struct {
	principal string
	bytes     int64
}

// snapUsed is what the principal's snapshots take: the bytes on disk,
// but for the temporary directories of saves in flight, whose claims
// count instead. Call it with the principal's lock held.
func (m *Manager) snapUsed(root, principal string) int64 {
	st := &m.snaps
	skip := map[string]bool{}
	var claimed int64
	st.claimMu.Lock()
	for dir, c := range st.claims {
		if c.principal == principal {
			skip[dir] = true
			claimed += c.bytes
		}
	}
	st.claimMu.Unlock()
	return treeBytes(principalDir(root, principal), skip) + claimed
}

// snapClaim returns the budget of a save of principal's into tmp (see
// sandbox.WithSnapshotBudget): the size its box declares is claimed
// against the principal's quota before any of it is written, and refused
// over it. release forgets the claim; call it once tmp is kept under
// another name or removed. what names the save in the error.
func (m *Manager) snapClaim(root, principal, tmp, what string) (claim func(int64) error, release func()) {
	st := &m.snaps
	claim = func(n int64) error {
		defer st.locks.lock(principal)()
		return m.claimLocked(root, principal, tmp, n, what)
	}
	release = func() {
		defer st.locks.lock(principal)()
		st.claimMu.Lock()
		delete(st.claims, tmp)
		st.claimMu.Unlock()
		m.state.release(tmp)
	}
	return claim, release
}

// claimLocked claims n bytes for the save into tmp if they fit in the
// principal's quota, replacing what it claimed before. Call it with the
// principal's lock held.
func (m *Manager) claimLocked(root, principal, tmp string, n int64, what string) error {
	st := &m.snaps
	st.claimMu.Lock()
	if st.claims == nil {
		st.claims = make(map[string]snapClaim)
	}
	st.claims[tmp] = snapClaim{principal: principal}
	st.claimMu.Unlock()
	quota := m.opts.Snapshots.Quota
	if used := m.snapUsed(root, principal); used+n > quota {
		return fmt.Errorf("%w: %s (%d bytes) would take your snapshots to %d of %d bytes (--snapshot-quota); delete_snapshot one you no longer need", ErrSnapshotQuota, what, n, used+n, quota)
	}
	if err := m.state.claim(tmp, n, key{}); err != nil {
		return err
	}
	st.claimMu.Lock()
	st.claims[tmp] = snapClaim{principal: principal, bytes: n}
	st.claimMu.Unlock()
	return nil
}

// keyedMutex is one mutex per key, forgotten while no one holds or waits
// for it.
type keyedMutex struct {
	mu sync.Mutex
	m  map[string]*keyedEntry
}

type keyedEntry struct {
	sync.Mutex
	refs int
}

// lock locks key's mutex and returns what unlocks it.
func (k *keyedMutex) lock(key string) (unlock func()) {
	k.mu.Lock()
	if k.m == nil {
		k.m = make(map[string]*keyedEntry)
	}
	e := k.m[key]
	if e == nil {
		e = &keyedEntry{}
		k.m[key] = e
	}
	e.refs++
	k.mu.Unlock()
	e.Lock()
	return func() {
		e.Unlock()
		k.mu.Lock()
		if e.refs--; e.refs == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
}

func (m *Manager) snapRoot() (string, error) {
	st := &m.snaps
	st.once.Do(func() {
		o := m.opts.Snapshots
		if o.StateDir != "" {
			st.root = filepath.Join(o.StateDir, "snapshots")
			if st.err = os.MkdirAll(st.root, 0o700); st.err == nil {
				st.err = os.Chmod(st.root, 0o700)
			}
		} else {
			st.root, st.err = os.MkdirTemp("", "kiln-snapshots-")
			st.private = true
		}
		if st.err != nil {
			st.err = fmt.Errorf("making the snapshot directory: %w", st.err)
		}
	})
	return st.root, st.err
}

// closeSnapshots removes a private snapshot directory.
func (m *Manager) closeSnapshots() {
	st := &m.snaps
	st.once.Do(func() {}) // none made after Close
	if st.private && st.root != "" {
		os.RemoveAll(st.root)
	}
}

// principalDir is the principal's directory: a digest, so that any
// principal name is a safe file name and none can name another's.
func principalDir(root, principal string) string {
	h := sha256.Sum256([]byte("kiln-principal\x00" + principal))
	return filepath.Join(root, "p-"+hex.EncodeToString(h[:16]))
}

// sessionDir is a session's snapshot directory. Session and snapshot names
// pass ValidName, which allows "." and "..": the prefix keeps them names.
func sessionDir(root, principal, session string) string {
	return filepath.Join(principalDir(root, principal), "s-"+session)
}

func snapDir(root, principal, session, name string) string {
	return filepath.Join(sessionDir(root, principal, session), "n-"+name)
}

// SnapshotEntry describes one kept snapshot.
type SnapshotEntry struct {
	Name string
	*sandbox.SnapshotInfo
	// Unreadable says why the snapshot's manifest cannot be read ("":
	// it can): it cannot be restored, but it still counts against
	// --max-snapshots and the quota until it is deleted. Its SnapshotInfo
	// has only Bytes then.
	Unreadable string
}

// Snapshots lists the principal's snapshots of session, oldest first.
func (m *Manager) Snapshots(principal, session string) ([]SnapshotEntry, error) {
	if m.opts.Mode == ModePerCall {
		return nil, ErrPerCallMode
	}
	if !ValidName(session) {
		return nil, ErrBadName
	}
	root, err := m.snapRoot()
	if err != nil {
		return nil, err
	}
	return listSnapshots(sessionDir(root, principal, session)), nil
}

func listSnapshots(dir string) []SnapshotEntry {
	ents, _ := os.ReadDir(dir)
	var out []SnapshotEntry
	for _, e := range ents {
		name, ok := strings.CutPrefix(e.Name(), "n-")
		if !ok || !e.IsDir() {
			continue
		}
		if !ValidName(name) {
			continue
		}
		// A kept snapshot that cannot be read is listed and counted all
		// the same, so that it is seen, and deleted, rather than taking
		// room no one can see. (Half-written ones have a temporary name.)
		path := filepath.Join(dir, e.Name())
		info, err := sandbox.ReadManifest(path)
		if err != nil {
			out = append(out, SnapshotEntry{Name: name, SnapshotInfo: &sandbox.SnapshotInfo{Bytes: treeBytes(path, nil)}, Unreadable: err.Error()})
			continue
		}
		out = append(out, SnapshotEntry{Name: name, SnapshotInfo: info})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out
}

// treeBytes is the bytes of the regular files under dir, leaving out the
// directories in skip.
func treeBytes(dir string, skip map[string]bool) int64 {
	var n int64
	filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		switch {
		case err != nil:
		case d.IsDir() && skip[path]:
			return filepath.SkipDir
		case d.Type().IsRegular():
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// DeleteSnapshot removes one of the principal's snapshots of session.
func (m *Manager) DeleteSnapshot(principal, session, name string) error {
	if m.opts.Mode == ModePerCall {
		return ErrPerCallMode
	}
	if !ValidName(session) || !ValidName(name) {
		return ErrBadName
	}
	root, err := m.snapRoot()
	if err != nil {
		return err
	}
	dir := snapDir(root, principal, session, name)
	if _, err := os.Lstat(dir); err != nil {
		return fmt.Errorf("%w %q of session %q", ErrNoSnapshot, name, session)
	}
	return os.RemoveAll(dir)
}

// snapshotter is the session box's ability to save itself, or an error
// that names the backend.
func (m *Manager) snapshotter(box sandbox.Sandbox) (sandbox.Snapshotter, error) {
	if s, ok := inner(box).(sandbox.Snapshotter); ok {
		return s, nil
	}
	return nil, fmt.Errorf("%w on the %s backend: its boxes cannot save their state", ErrNoSnapshotBoxes, m.opts.Backend.Name())
}

// saveTo snapshots box into a new directory dir (its parent exists).
func (m *Manager) saveTo(ctx context.Context, box sandbox.Sandbox, dir string) (*sandbox.SnapshotInfo, error) {
	sn, err := m.snapshotter(box)
	if err != nil {
		return nil, err
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("making the snapshot directory: %w", err)
	}
	ctx = sandbox.WithSnapshotLimit(ctx, sandbox.SnapshotLimitFor(m.opts.Limits))
	info, err := sn.Snapshot(ctx, dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if info.Backend == "" {
		info.Backend = m.opts.Backend.Name()
		if err := sandbox.WriteManifest(dir, info); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	return info, nil
}

// loadBox takes a fresh box and loads the snapshot in dir into it.
func (m *Manager) loadBox(ctx context.Context, dir string) (sandbox.Sandbox, []string, error) {
	box, err := m.getBox(ctx)
	if err != nil {
		if errors.Is(err, ErrBusy) {
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("starting sandbox: %w", err)
	}
	dropped, err := sandbox.LoadInto(ctx, inner(box), dir, m.opts.Backend.Name())
	if err != nil {
		box.Close()
		return nil, nil, err
	}
	return box, dropped, nil
}

func tempName() string {
	b := make([]byte, 8)
	rand.Read(b)
	return ".tmp-" + hex.EncodeToString(b)
}

// Snapshot saves the session's state as the snapshot called name,
// replacing one of that name. The session keeps running.
func (s *Session) Snapshot(ctx context.Context, name string) (*sandbox.SnapshotInfo, error) {
	m := s.m
	if !ValidName(name) {
		return nil, fmt.Errorf("snapshot names: %w", ErrBadName)
	}
	root, err := m.snapRoot()
	if err != nil {
		return nil, err
	}
	o := m.opts.Snapshots
	sdir := sessionDir(root, s.principal, s.name)
	var info *sandbox.SnapshotInfo
	err = s.WithLiveBox(ctx, func(box sandbox.Sandbox) error {
		kept := listSnapshots(sdir)
		replacing := false
		for _, e := range kept {
			replacing = replacing || e.Name == name
		}
		if len(kept) >= o.Max && !replacing {
			names := make([]string, len(kept))
			for i, e := range kept {
				names[i] = e.Name
			}
			return fmt.Errorf("%w: it keeps %d (--max-snapshots): %s. Snapshot under one of these names to replace it, or delete_snapshot one", ErrSnapshotsFull, o.Max, strings.Join(names, ", "))
		}
		unlock := m.snaps.locks.lock(s.principal)
		used := m.snapUsed(root, s.principal)
		unlock()
		if used >= o.Quota {
			return fmt.Errorf("%w: %d of %d bytes (--snapshot-quota); delete_snapshot one you no longer need", ErrSnapshotQuota, used, o.Quota)
		}
		if err := os.MkdirAll(sdir, 0o700); err != nil {
			return fmt.Errorf("making the snapshot directory: %w", err)
		}
		tmp := filepath.Join(sdir, tempName())
		claim, release := m.snapClaim(root, s.principal, tmp, "this snapshot")
		defer release()
		if info, err = m.saveTo(sandbox.WithSnapshotBudget(ctx, claim), box, tmp); err != nil {
			return err
		}
		// The manifest, or a box without a budget, may take more than
		// was claimed: what is kept must fit too.
		defer m.snaps.locks.lock(s.principal)()
		if err := m.claimLocked(root, s.principal, tmp, info.Bytes, "this snapshot"); err != nil {
			os.RemoveAll(tmp)
			return err
		}
		dst := snapDir(root, s.principal, s.name, name)
		os.RemoveAll(dst)
		if err := os.Rename(tmp, dst); err != nil {
			os.RemoveAll(tmp)
			return fmt.Errorf("keeping the snapshot: %w", err)
		}
		return nil
	})
	if errors.Is(err, ErrNoBox) {
		return nil, ErrNothingToSave
	}
	if err == nil {
		m.observeSession(event.SessionSnapshot, s)
	}
	return info, err
}

// RestoreReport is what a rollback or a fork did.
type RestoreReport struct {
	Info    *sandbox.SnapshotInfo // what was saved (and dropped while saving)
	Dropped []string              // what the new box could not load
	Took    time.Duration         // the whole operation
}

// Restore rolls the session back to its snapshot called name: a fresh box
// with the snapshot loaded replaces the session's box, which is
// destroyed. If loading fails, the session keeps its box.
func (s *Session) Restore(ctx context.Context, name string) (*RestoreReport, error) {
	start := time.Now()
	m := s.m
	if !ValidName(name) {
		return nil, fmt.Errorf("snapshot names: %w", ErrBadName)
	}
	root, err := m.snapRoot()
	if err != nil {
		return nil, err
	}
	dir := snapDir(root, s.principal, s.name, name)
	info, err := sandbox.ReadManifest(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w %q of session %q; list_snapshots shows those it has", ErrNoSnapshot, name, s.name)
		}
		return nil, err
	}
	if err := s.acquire(ctx); err != nil {
		return nil, err
	}
	defer s.release()
	box, dropped, err := m.loadBox(ctx, dir)
	if err != nil {
		return nil, err
	}
	if err := s.replaceBox(box); err != nil {
		return nil, err
	}
	m.observeSession(event.SessionRestore, s)
	return &RestoreReport{Info: info, Dropped: dropped, Took: time.Since(start)}, nil
}

// replaceBox makes box the session's box, destroying the old one. Call it
// on the session's turn.
func (s *Session) replaceBox(box sandbox.Sandbox) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		box.Close()
		return ErrReset
	}
	old := s.box
	s.box, s.lost, s.hits = box, "", nil
	s.mu.Unlock()
	if old != nil {
		old.Close()
	}
	return nil
}

// Fork makes the principal's new session dst a copy of session src as it
// is now: its kernel's globals and its workspace. src keeps running,
// untouched. Only the principal's own sessions can be forked.
func (m *Manager) Fork(ctx context.Context, principal, src, dst string) (*RestoreReport, error) {
	start := time.Now()
	if m.opts.Mode == ModePerCall {
		return nil, ErrPerCallMode
	}
	if !ValidName(src) || !ValidName(dst) {
		return nil, ErrBadName
	}
	if src == dst {
		return nil, fmt.Errorf("%w: fork %q into a new name", ErrSnapshotExists, src)
	}
	from, ok := m.Lookup(principal, src)
	if !ok {
		return nil, fmt.Errorf("%w %q: there is nothing to fork", ErrNoSession, src)
	}
	if _, ok := m.Lookup(principal, dst); ok {
		return nil, fmt.Errorf("%w: %q; choose another name, or reset_session it first", ErrSnapshotExists, dst)
	}
	root, err := m.snapRoot()
	if err != nil {
		return nil, err
	}
	pdir := principalDir(root, principal)
	if err := os.MkdirAll(pdir, 0o700); err != nil {
		return nil, fmt.Errorf("making the snapshot directory: %w", err)
	}
	// The copy counts against the principal's quota while it exists.
	tmp := filepath.Join(pdir, tempName())
	const what = "the fork's temporary copy of the session"
	claim, release := m.snapClaim(root, principal, tmp, what)
	defer release()
	defer os.RemoveAll(tmp)
	var info *sandbox.SnapshotInfo
	err = from.WithLiveBox(ctx, func(box sandbox.Sandbox) error {
		if info, err = m.saveTo(sandbox.WithSnapshotBudget(ctx, claim), box, tmp); err != nil {
			return err
		}
		return claim(info.Bytes)
	})
	if errors.Is(err, ErrNoBox) {
		return nil, fmt.Errorf("session %q: %w", src, ErrNothingToSave)
	}
	if err != nil {
		return nil, err
	}
	to, err := m.Get(principal, dst)
	if err != nil {
		return nil, err
	}
	if err := to.acquire(ctx); err != nil {
		return nil, err
	}
	defer to.release()
	to.mu.Lock()
	taken := to.box != nil
	to.mu.Unlock()
	if taken { // another fork or a call got there first
		return nil, fmt.Errorf("%w: %q", ErrSnapshotExists, dst)
	}
	box, dropped, err := m.loadBox(ctx, tmp)
	if err != nil {
		m.Reset(principal, dst)
		return nil, err
	}
	if err := to.replaceBox(box); err != nil {
		return nil, err
	}
	m.observeSession(event.SessionSnapshot, from)
	m.observeSession(event.SessionRestore, to)
	return &RestoreReport{Info: info, Dropped: dropped, Took: time.Since(start)}, nil
}
