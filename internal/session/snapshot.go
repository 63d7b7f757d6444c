package session

import (
	"context"
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
// Snapshots live in the snapshot store (store.go), beside hibernated
// sessions: <session dir>/n-<name>/. With a state directory they are kept
// across restarts; else the store is a private temporary directory
// removed at Close.

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

// storeOnce is the manager's store, opened on first use (at start with
// hibernation): without a state directory it is a temporary directory,
// made only if a snapshot is taken.
type storeOnce struct {
	once sync.Once
	st   *store
	err  error
}

// store returns the manager's store, opening it on first use.
func (m *Manager) store() (*store, error) {
	o := &m.saves
	o.once.Do(func() {
		o.st, o.err = openStore(m.storeConfig())
	})
	return o.st, o.err
}

// close removes a private store; none is opened after it.
func (o *storeOnce) close() {
	o.once.Do(func() { o.err = ErrShutdown })
	if o.st != nil {
		o.st.close()
	}
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
	st, err := m.store()
	if err != nil {
		return nil, err
	}
	dir := st.sessionDir(principal, session)
	if checkOwner(dir, principal, session, true) != nil {
		return nil, nil
	}
	return listSnapshots(dir), nil
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
			out = append(out, SnapshotEntry{Name: name, SnapshotInfo: &sandbox.SnapshotInfo{Bytes: dirSize(path)}, Unreadable: err.Error()})
			continue
		}
		out = append(out, SnapshotEntry{Name: name, SnapshotInfo: info})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out
}

// DeleteSnapshot removes one of the principal's snapshots of session.
func (m *Manager) DeleteSnapshot(principal, session, name string) error {
	if m.opts.Mode == ModePerCall {
		return ErrPerCallMode
	}
	if !ValidName(session) || !ValidName(name) {
		return ErrBadName
	}
	st, err := m.store()
	if err != nil {
		return err
	}
	dir := st.snapDir(principal, session, name)
	if _, err := os.Lstat(dir); err != nil || checkOwner(filepath.Dir(dir), principal, session, true) != nil {
		return fmt.Errorf("%w %q of session %q", ErrNoSnapshot, name, session)
	}
	return st.remove(dir)
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

// Snapshot saves the session's state as the snapshot called name,
// replacing one of that name. The session keeps running.
func (s *Session) Snapshot(ctx context.Context, name string) (*sandbox.SnapshotInfo, error) {
	m := s.m
	if !ValidName(name) {
		return nil, fmt.Errorf("snapshot names: %w", ErrBadName)
	}
	st, err := m.store()
	if err != nil {
		return nil, err
	}
	o := m.opts.Snapshots
	var info *sandbox.SnapshotInfo
	err = s.WithLiveBox(ctx, func(box sandbox.Sandbox) error {
		kept := listSnapshots(st.sessionDir(s.principal, s.name))
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
		if used := st.namedUsed(s.principal); used >= o.Quota {
			return fmt.Errorf("%w: %d of %d bytes (--snapshot-quota); delete_snapshot one you no longer need", ErrSnapshotQuota, used, o.Quota)
		}
		var err error
		_, info, err = st.save(ctx, box, saveReq{principal: s.principal, session: s.name, name: name})
		return err
	})
	if errors.Is(err, ErrNoBox) {
		return nil, ErrNothingToSave
	}
	if err != nil {
		return nil, err
	}
	m.observeSession(event.SessionSnapshot, s)
	return info, nil
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
	st, err := m.store()
	if err != nil {
		return nil, err
	}
	dir := st.snapDir(s.principal, s.name, name)
	info, err := sandbox.ReadManifest(dir)
	if err == nil {
		err = checkOwner(filepath.Dir(dir), s.principal, s.name, true)
	}
	if errors.Is(err, errNotOwner) {
		err = os.ErrNotExist
	}
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
	st, err := m.store()
	if err != nil {
		return nil, err
	}
	// The copy counts against the principal's quota while it exists.
	var tmp string
	var info *sandbox.SnapshotInfo
	err = from.WithLiveBox(ctx, func(box sandbox.Sandbox) error {
		var err error
		tmp, info, err = st.save(ctx, box, saveReq{principal: principal, session: src, fork: true})
		return err
	})
	if tmp != "" {
		defer st.forget(tmp)
	}
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
