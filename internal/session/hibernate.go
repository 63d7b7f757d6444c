package session

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strings"
	"sync"
	"time"

	"kiln/internal/event"
	"kiln/internal/sandbox"
)

// Hibernation: with a state directory, a session idle past
// HibernateOptions.After is snapshotted to disk and its box destroyed,
// instead of being thrown away at the idle TTL. The next call naming it
// restores it transparently, in this server or in the next one (a session
// found on disk is resumed at first use), and its result says so and how
// long it took. Shutdown (Manager.Close) snapshots live sessions, and a
// live session is checkpointed after a call once its last snapshot is
// older than CheckpointEvery, so that after kill -9 a session loses at most
// the work of the last CheckpointEvery (plus one sweep of the reaper).
//
// Saves live in the snapshot store (store.go), beside named snapshots:
// the newest save of a session is <session dir>/snap-<unix ns>/, and a
// session is only ever restored for the principal named in its owner file.

// HibernateOptions configure hibernation. An empty Dir turns it off.
type HibernateOptions struct {
	// Dir turns hibernation on. The saves live in the snapshot store
	// (store.go): under SnapshotOptions.StateDir when it is set (kiln sets
	// both from --state-dir), else in Dir itself. What an older kiln
	// hibernated in Dir is moved into the store at start.
	Dir string
	// After is how long a session stays idle before it is hibernated
	// (DefaultHibernateAfter).
	After time.Duration
	// TTL is how long a hibernated session is kept on disk after it was
	// saved (DefaultHibernateTTL).
	TTL time.Duration
	// Quota bounds the bytes on disk of one principal's saved sessions
	// (DefaultHibernateQuota). Saving past it expires that principal's
	// oldest saved sessions first; a snapshot larger than the whole quota
	// is not kept.
	Quota int64
	// CheckpointEvery bounds the work a session loses if kiln is killed
	// without a chance to save it (DefaultCheckpointEvery); negative: no
	// checkpoints, only hibernation at idle and at shutdown.
	CheckpointEvery time.Duration
	// SaveTimeout bounds the total time Close spends saving live sessions
	// (DefaultHibernateSaveTimeout), and each save of the reaper.
	SaveTimeout time.Duration
	// Shared, if set, keeps each session's newest save in storage other
	// servers share too, and a session resumes from the newest save of
	// any of them (shared.go).
	Shared SharedSaves
}

// Defaults of HibernateOptions; kiln's flags default to them too.
const (
	DefaultHibernateAfter       = 10 * time.Minute
	DefaultHibernateTTL         = 7 * 24 * time.Hour
	DefaultHibernateQuota       = 2 << 30
	DefaultCheckpointEvery      = 5 * time.Minute
	DefaultHibernateSaveTimeout = 20 * time.Second
)

func (o *HibernateOptions) defaults() {
	if o.After <= 0 {
		o.After = DefaultHibernateAfter
	}
	if o.TTL <= 0 {
		o.TTL = DefaultHibernateTTL
	}
	if o.Quota <= 0 {
		o.Quota = DefaultHibernateQuota
	}
	if o.CheckpointEvery == 0 {
		o.CheckpointEvery = DefaultCheckpointEvery
	}
	if o.SaveTimeout <= 0 {
		o.SaveTimeout = DefaultHibernateSaveTimeout
	}
}

// hibState is what a Session knows of its saved state (guarded by its mu).
type hibState struct {
	// hibernated: the box was saved and destroyed; the next call resumes.
	hibernated bool
	// mark is when the newest snapshot was taken, or when the session's
	// unsaved work began; dirty says a call ran since the last snapshot.
	mark  time.Time
	dirty bool
	// failed: the last attempt to hibernate failed; the reaper does not
	// retry until the session is used again, and the idle TTL applies.
	failed bool
	// saving: a checkpoint is queued or running.
	saving bool
	// waking: the Ledger counted the session in, and its resume has not
	// ended yet (wake).
	waking bool
}

// hibernateIdle, on each round of the reaper: starts saving sessions idle
// past After (hibernation) and those with unsaved work older than
// CheckpointEvery (checkpoints), and expires saved sessions past the TTL.
// It does not wait for the saves: a box can stall its own save for up to
// SaveTimeout, and the reaper's other work (the idle TTL, expiry) must
// not wait behind it. The saves run at most reapSavers at once and one
// per principal, oldest idle first, so one principal's stalled saves
// hold up one slot, never another principal's sessions; a session left
// out is taken on a later round.
func (m *Manager) hibernateIdle() {
	h := m.hib
	type candidate struct {
		s    *Session
		idle bool // hibernate it; else checkpoint it
		used time.Time
	}
	var due []candidate
	now := time.Now()
	m.mu.Lock()
	for _, s := range m.sessions {
		s.mu.Lock()
		switch {
		case s.box == nil || s.job != nil:
		case !s.hib.failed && now.Sub(s.lastUsed) > h.opts.After:
			due = append(due, candidate{s, true, s.lastUsed})
		case !s.hib.failed && s.hib.dirty && h.opts.CheckpointEvery > 0 && now.Sub(s.hib.mark) >= h.opts.CheckpointEvery:
			due = append(due, candidate{s, false, s.hib.mark})
		}
		s.mu.Unlock()
	}
	m.mu.Unlock()
	sort.Slice(due, func(i, j int) bool { return due[i].used.Before(due[j].used) })
	for _, c := range due {
		if !h.savers.take(c.s.principal) {
			continue
		}
		save := func() { m.checkpoint(c.s, false) }
		if c.idle {
			save = func() { m.hibernate(c.s) }
		}
		if !h.goSave(func() { defer h.savers.give(c.s.principal); save() }) {
			h.savers.give(c.s.principal)
			break // shutting down: the shutdown saves them
		}
	}
	h.st.expire(h.opts.TTL)
	if h.sh != nil {
		go h.sh.expire(h.opts.TTL, m.sharedKeys)
	}
}

// sharedKeys are the shared-storage keys of the sessions this server
// holds: the sweep of shared storage keeps their saves.
func (m *Manager) sharedKeys() map[string]bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	keys := make(map[string]bool, len(m.sessions))
	for k := range m.sessions {
		keys[sharedKey(k.principal, k.name)] = true
	}
	return keys
}

// reapSavers bounds the saves the reaper runs at once.
const reapSavers = 4

// saverSlots bound the reaper's saves in flight: reapSavers in all, one
// per principal.
type saverSlots struct {
	mu   sync.Mutex
	busy map[string]bool // principals with a save in flight
}

// take claims a slot for a save of principal's; false if none is free or
// the principal already has one.
func (q *saverSlots) take(principal string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.busy == nil {
		q.busy = make(map[string]bool)
	}
	if q.busy[principal] || len(q.busy) >= reapSavers {
		return false
	}
	q.busy[principal] = true
	return true
}

func (q *saverSlots) give(principal string) {
	q.mu.Lock()
	delete(q.busy, principal)
	q.mu.Unlock()
}

// goSave runs save in the background, counted by wg so that shutdown
// waits for it; false, and nothing runs, once shutdown has begun.
func (h *hibernator) goSave(save func()) bool {
	h.stopMu.Lock()
	defer h.stopMu.Unlock()
	if h.stopping {
		return false
	}
	h.wg.Add(1)
	go func() { defer h.wg.Done(); save() }()
	return true
}

// hibernator is hibernation's schedule: which sessions are saved when.
// The saves themselves are the store's.
type hibernator struct {
	opts HibernateOptions
	st   *store
	sh   *sharer        // nil without HibernateOptions.Shared
	wg   sync.WaitGroup // checkpoints and the reaper's saves in flight
	// savers bound the reaper's saves in flight (hibernateIdle).
	savers saverSlots
	// stopping is set once shutdown has begun: no new checkpoint starts
	// (wg.Add must not race with the shutdown's wg.Wait).
	stopMu   sync.Mutex
	stopping bool
}

// save snapshots box as the session's newest save, replacing its last.
// live says which sessions are live, for what the save expires (nil: the
// manager's sessions). Call it on the session's turn.
func (h *hibernator) save(ctx context.Context, s *Session, box sandbox.Sandbox, live func(principal, name string) bool) (*sandbox.SnapshotInfo, error) {
	dir, info, err := h.st.save(ctx, box, saveReq{principal: s.principal, session: s.name, hib: true, live: live})
	if err == nil && h.sh != nil {
		h.sh.push(s.principal, s.name, dir)
	}
	return info, err
}

// forget drops the session's saved state here and in shared storage;
// true if this server had some.
func (h *hibernator) forget(principal, name string) bool {
	if h.sh != nil {
		h.sh.drop(principal, name)
	}
	return h.st.removeHib(principal, name)
}

// hibernate saves an idle session and destroys its box, if the session's
// turn is free; the next call resumes it.
func (m *Manager) hibernate(s *Session) {
	select {
	case <-s.turn:
	default:
		return // a call is running; it is not idle after all
	}
	defer func() { s.turn <- struct{}{} }() // not release: hibernating is not a use
	m.saveSession(s, true)
}

// saveSession saves a live session's box on the session's turn:
// hibernating destroys the box once it is saved (the next call resumes
// it), a checkpoint leaves it running.
func (m *Manager) saveSession(s *Session, hibernate bool) {
	s.mu.Lock()
	box, busy := s.box, s.job != nil || s.closed
	s.mu.Unlock()
	if busy || box == nil || !alive(box) {
		return
	}
	ctx, cancel := m.saveContext()
	defer cancel()
	start := time.Now()
	info, err := m.hib.save(ctx, s, box, nil)
	if err != nil { // not retried until the next call
		msg := "could not checkpoint a session"
		if hibernate {
			msg = "could not hibernate an idle session; it stays live until --idle-ttl"
		}
		m.log.Warn(msg, "session", s.name, "principal", s.principal, "err", err)
		s.mu.Lock()
		s.hib.failed = true
		s.mu.Unlock()
		return
	}
	s.mu.Lock()
	if !hibernate {
		s.hib.mark, s.hib.dirty = start, false
		s.mu.Unlock()
		m.log.Debug("session checkpointed", "session", s.name, "principal", s.principal, "bytes", info.Bytes, "took", time.Since(start))
		return
	}
	if s.box == box {
		s.box = nil
	}
	s.hib = hibState{hibernated: true, mark: time.Now()}
	s.mu.Unlock()
	box.Close()
	m.log.Info("session hibernated", "session", s.name, "principal", s.principal, "bytes", info.Bytes, "took", info.Took, "dropped", len(info.Dropped))
	m.observeSession(event.SessionHibernate, s)
	m.ledgerSync(s.principal)
}

// saveContext bounds one save of the reaper; closing the manager cuts it.
func (m *Manager) saveContext() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), m.hib.opts.SaveTimeout)
	go func() {
		select {
		case <-m.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// touched records, on the session's turn after a call, that the session
// has unsaved work, and starts a checkpoint in the background if its last
// snapshot is older than CheckpointEvery.
func (s *Session) touched() {
	h := s.m.hib
	if h == nil {
		return
	}
	now := time.Now()
	s.mu.Lock()
	if s.hib.mark.IsZero() {
		s.hib.mark = now
	}
	s.hib.dirty, s.hib.failed = true, false
	due := h.opts.CheckpointEvery > 0 && now.Sub(s.hib.mark) >= h.opts.CheckpointEvery && !s.hib.saving
	s.mu.Unlock()
	if due {
		s.m.checkpoint(s, true)
	}
}

// checkpoint saves a live session and keeps it running: in the background
// (once the call that asked for it has released the turn), or now if no
// call is running (the reaper, which must not wait behind one).
func (m *Manager) checkpoint(s *Session, background bool) {
	s.mu.Lock()
	if s.hib.saving {
		s.mu.Unlock()
		return
	}
	s.hib.saving = true
	s.mu.Unlock()
	done := func() {
		s.mu.Lock()
		s.hib.saving = false
		s.mu.Unlock()
	}
	if !background { // the reaper: never wait behind a running call
		defer done()
		select {
		case <-s.turn:
		default:
			return
		}
		defer func() { s.turn <- struct{}{} }()
		m.saveSession(s, false)
		return
	}
	run := func() {
		defer done()
		select {
		case <-s.turn:
		case <-s.closing:
			return
		case <-m.stop:
			return
		}
		defer func() { s.turn <- struct{}{} }()
		m.saveSession(s, false)
	}
	if !m.hib.goSave(run) {
		done() // the shutdown saves it
	}
}

// hibernateAll saves the live sessions at shutdown, a few at a time, all
// within SaveTimeout. A session whose call does not end in time keeps its
// last checkpoint.
func (m *Manager) hibernateAll(all map[key]*Session) {
	m.hib.stopMu.Lock()
	m.hib.stopping = true
	m.hib.stopMu.Unlock()
	m.hib.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), m.hib.opts.SaveTimeout)
	defer cancel()
	start := time.Now()
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	var mu sync.Mutex
	saved := 0
	for _, s := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				return
			}
			defer func() { <-sem }()
			if m.saveAtClose(ctx, s) {
				mu.Lock()
				saved++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if saved > 0 || len(all) > 0 {
		m.log.Info("hibernated sessions at shutdown", "saved", saved, "sessions", len(all), "took", time.Since(start))
	}
	if m.hib.sh != nil { // the uploads get a SaveTimeout of their own
		ctx, cancel := context.WithTimeout(context.Background(), m.hib.opts.SaveTimeout)
		defer cancel()
		m.hib.sh.wait(ctx)
	}
}

func (m *Manager) saveAtClose(ctx context.Context, s *Session) bool {
	for {
		select {
		case <-s.turn:
		case <-ctx.Done():
			m.log.Warn("a call still running at shutdown: the session keeps its last checkpoint", "session", s.name, "principal", s.principal)
			return false
		}
		s.mu.Lock()
		box, job := s.box, s.job
		s.mu.Unlock()
		if box == nil || !alive(box) {
			s.turn <- struct{}{}
			return false
		}
		if job == nil {
			defer func() { s.turn <- struct{}{} }()
			break
		}
		s.turn <- struct{}{} // the job needs the turn to end
		select {             // it was cancelled; it ends within the grace period
		case <-job.done:
		case <-ctx.Done():
			return false
		}
	}
	s.mu.Lock()
	box := s.box
	s.mu.Unlock()
	info, err := m.hib.save(ctx, s, box, func(string, string) bool { return true })
	if err != nil {
		m.log.Warn("could not hibernate a session at shutdown", "session", s.name, "principal", s.principal, "err", err)
		return false
	}
	m.log.Debug("session hibernated", "session", s.name, "principal", s.principal, "bytes", info.Bytes)
	m.observeSession(event.SessionHibernate, s)
	return true
}

// resume starts the session's box from its saved state, if it has some:
// box is nil when there is none. note says what happened, for the call's
// result (a failed resume gives a fresh box and a note saying why).
func (s *Session) resume(ctx context.Context, from string) (box sandbox.Sandbox, note string, err error) {
	m, h := s.m, s.m.hib
	if h.sh != nil && h.sh.pull(ctx, s.principal, s.name) {
		from = fromShared
	}
	snap, err := h.st.latest(s.principal, s.name)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if s.wasHibernated() { // expired (--hibernate-ttl, --hibernate-quota) meanwhile
			s.clearHibernated()
			return nil, fmt.Sprintf("this session was hibernated, and its saved state has since expired (--hibernate-ttl %s, or the disk quota); %s: %s", h.opts.TTL, msgNewBox, m.survived(true, true)), nil
		}
		return nil, "", nil
	case err != nil:
		m.log.Warn("a saved session could not be read; starting a fresh sandbox", "session", s.name, "principal", s.principal, "err", err)
		if !errors.Is(err, errNotOwner) {
			h.forget(s.principal, s.name)
		}
		s.clearHibernated()
		return nil, fmt.Sprintf("this session's saved state could not be read (%v); %s: %s", err, msgNewBox, m.survived(true, true)), nil
	}
	s.mu.Lock()
	asleep := s.asleep()
	s.mu.Unlock()
	if asleep { // it leaves the hibernated, uncounted sessions
		if err := m.wake(s); err != nil {
			return nil, "", err
		}
		defer m.woken(s)
	}
	start := time.Now()
	box, dropped, err := m.restoreBox(ctx, snap.dir)
	took := time.Since(start)
	if err != nil {
		if errors.Is(err, ErrBusy) || ctx.Err() != nil {
			return nil, "", err
		}
		m.log.Warn("could not resume a saved session; starting a fresh sandbox", "session", s.name, "principal", s.principal, "err", err)
		h.forget(s.principal, s.name)
		s.clearHibernated()
		return nil, fmt.Sprintf("this session's saved state could not be restored (%v); %s: %s", err, msgNewBox, m.survived(true, true)), nil
	}
	s.mu.Lock()
	s.hib = hibState{mark: snap.saved}
	s.mu.Unlock()
	m.log.Info("session resumed", "session", s.name, "principal", s.principal, "took", took, "saved", snap.saved)
	m.observeSession(event.SessionResume, s)
	note = fmt.Sprintf("resumed this session from %s in %s (saved %s ago): its variables and workspace files are as they were; processes that were running in it were not kept",
		from, took.Round(time.Millisecond), time.Since(snap.saved).Round(time.Second))
	if len(dropped) > 0 {
		note += fmt.Sprintf("; not restored: %s", strings.Join(dropped[:min(len(dropped), 10)], "; "))
		if len(dropped) > 10 {
			note += fmt.Sprintf(" and %d more", len(dropped)-10)
		}
	}
	return box, note, nil
}

// wake admits a hibernated session to the live ones: within this
// server's quotas, and the Ledger's, which counts it as waking until
// woken.
func (m *Manager) wake(s *Session) error {
	m.mu.Lock()
	err := m.quotaFor(s.principal, s)
	m.mu.Unlock()
	if err != nil || m.opts.Ledger == nil {
		return err
	}
	done, err := m.admit(s.principal, s.name)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.hib.waking = true
	s.mu.Unlock()
	done()
	return nil
}

// woken ends wake: the session is live, or its resume failed and it is
// asleep still, and the Ledger counts it out.
func (m *Manager) woken(s *Session) {
	s.mu.Lock()
	failed := s.hib.waking
	s.hib.waking = false
	s.mu.Unlock()
	if failed {
		m.ledgerSync(s.principal)
	}
}

// asleep reports whether the session's state is only on disk: it was
// hibernated and nothing has given it a box since. Call it with s.mu held.
func (s *Session) asleep() bool { return s.hib.hibernated && s.box == nil }

func (s *Session) clearHibernated() {
	s.mu.Lock()
	s.hib.hibernated = false
	s.mu.Unlock()
}

// restoreBox starts a box from a snapshot under the cap on live boxes: a
// state-level snapshot is loaded into a box of the pool (already warm), a
// backend's own format is restored by the backend.
func (m *Manager) restoreBox(ctx context.Context, dir string) (sandbox.Sandbox, []string, error) {
	info, err := sandbox.ReadManifest(dir)
	if err != nil {
		return nil, nil, err
	}
	dropped := info.Dropped
	if info.Format == sandbox.FormatState {
		box, err := m.getBox(ctx)
		if err != nil {
			return nil, nil, err
		}
		more, err := sandbox.LoadInto(ctx, inner(box), dir, m.backendName())
		if err != nil {
			box.Close()
			return nil, nil, err
		}
		return box, append(dropped, more...), nil
	}
	w := m.slots.wait()
	t := time.NewTimer(m.opts.BoxWait)
	defer t.Stop()
	select {
	case <-w.ready:
	case <-t.C:
		m.slots.cancel(w)
		return nil, nil, &BusyError{Max: m.opts.MaxBoxes, Wait: m.opts.BoxWait, Mode: m.opts.Mode}
	case <-ctx.Done():
		m.slots.cancel(w)
		return nil, nil, ctx.Err()
	}
	spec := m.pool.spec
	spec.ID = newID()
	start := time.Now()
	box, report, err := sandbox.RestoreWithReport(ctx, m.opts.Backend, spec, dir)
	event.Emit(m.opts.Observer, event.Box{Time: time.Now(), Backend: m.backendName(), Duration: time.Since(start), Err: err != nil})
	if err != nil {
		m.slots.release()
		return nil, nil, err
	}
	counted, err := cutOrClose(ctx, &countedBox{Sandbox: box, release: m.slots.release})
	if err != nil {
		return nil, nil, err
	}
	return counted, append(dropped, report.Dropped...), nil
}

// hasSaved reports whether the principal's session has state on disk.
func (m *Manager) hasSaved(principal, name string) bool {
	if m.hib == nil || !ValidName(name) {
		return false
	}
	if _, err := m.hib.st.latest(principal, name); err == nil {
		return true
	}
	return m.hib.sh != nil && m.hib.sh.has(context.Background(), principal, name)
}

// forgetSaved drops the session's saved state: it was reset, or its box
// was lost and the session starts over.
func (m *Manager) forgetSaved(principal, name string) bool {
	if m.hib == nil {
		return false
	}
	return m.hib.forget(principal, name)
}

// wasHibernated reports whether the session's box was saved and destroyed.
func (s *Session) wasHibernated() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.asleep()
}

// expirable says whether the idle TTL may drop the session: with
// hibernation, a live session is hibernated instead, unless saving it
// failed.
func (s *Session) expirable() bool {
	if s.m.hib == nil {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.asleep() || s.hib.failed || s.box == nil
}

// fromSaved is ensure's step for a session that needs a box: one restored
// from its saved state if it has some, else nil, and a fresh box is made.
// note is why the old box is gone, if it was lost: its saved state is
// stale then, and dropped.
func (s *Session) fromSaved(ctx context.Context, lost, from string) (box sandbox.Sandbox, note string, err error) {
	if lost != "" {
		s.m.forgetSaved(s.principal, s.name)
		return nil, lost, nil
	}
	return s.fromCheckpoint(ctx, from)
}

// Where a session resumes from: its save at hibernation (or at shutdown,
// or a checkpoint, after a restart of kiln), or its last save after its
// box went with its host.
const (
	fromHibernation = "hibernation"
	fromLastSave    = "its last save"
	fromShared      = "its last save in shared storage"
)

// fromCheckpoint resumes the session from its last save, if it has one,
// and makes the box its own. note says how it went, "" with no save.
func (s *Session) fromCheckpoint(ctx context.Context, from string) (box sandbox.Sandbox, note string, err error) {
	box, note, err = s.resume(ctx, from)
	if err != nil || box == nil {
		return nil, note, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		box.Close()
		return nil, note, ErrReset
	}
	s.box = box
	s.mu.Unlock()
	return box, note, nil
}
