package session

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
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
// On disk, each principal has a directory named by a hash of its name, and
// each of its sessions one below it:
//
//	<Dir>/<sha256(principal)[:16] hex>/s-<session>/
//	    owner              {"principal": …, "session": …}, checked on restore
//	    snap-<unix ns>/    the newest complete snapshot (sandbox.SnapshotInfo manifest)
//	    snap-<unix ns>.tmp/  one being written; never read
//
// Every directory is 0700 and every file 0600, owned by the user running
// kiln (root): model code never sees them, and the host never decodes a
// box's bytes (the snapshot format is sandbox's business). A session is
// only ever restored for the principal named in its owner file.

// HibernateOptions configure hibernation. An empty Dir turns it off.
type HibernateOptions struct {
	// Dir holds hibernated sessions (kiln uses <--state-dir>/hibernated).
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

// Errors of hibernation.
var (
	// ErrHibernateQuota is a snapshot larger than the principal's quota.
	ErrHibernateQuota = errors.New("the snapshot is larger than the hibernation quota")
	// errNotOwner is a saved session whose owner file names another
	// principal or session than the one asking for it.
	errNotOwner = errors.New("the saved session belongs to someone else")
)

// PrepareStateDir creates dir (0700) if it is missing and checks that
// only the user running kiln can reach it: hibernated sessions hold
// whatever the boxes held.
func PrepareStateDir(dir string) error {
	if dir == "" {
		return errors.New("no state directory given")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating state directory: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("checking state directory: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("state directory %s is not a directory", dir)
	}
	if err := ownedByUs(dir, fi); err != nil {
		return err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("making state directory %s private: %w", dir, err)
		}
	}
	return nil
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
}

// Session states for SessionList.
const (
	StateLive       = "live"       // it has a sandbox
	StateNew        = "new"        // no sandbox yet, or since its last one was lost
	StateHibernated = "hibernated" // saved to disk; the next call resumes it
)

// SessionInfo is one of a principal's sessions, live or saved.
type SessionInfo struct {
	Name  string
	State string // StateLive, StateNew or StateHibernated
	// Saved is when its newest snapshot on disk was taken, and Bytes the
	// snapshot's size (zero: none).
	Saved    time.Time
	Bytes    int64
	LastUsed time.Time // live sessions
	// Unsaved: a call ran in the live session since its last save.
	Unsaved bool
}

// SessionList returns the principal's sessions: those in memory and those
// only on disk, by name.
func (m *Manager) SessionList(principal string) []SessionInfo {
	byName := map[string]SessionInfo{}
	if m.hib != nil {
		for _, si := range m.hib.list(principal) {
			byName[si.Name] = si
		}
	}
	m.mu.Lock()
	for k, s := range m.sessions {
		if k.principal != principal {
			continue
		}
		si := byName[k.name]
		si.Name = k.name
		s.mu.Lock()
		switch {
		case s.asleep() && !si.Saved.IsZero():
			si.State = StateHibernated
		case s.asleep(): // its save expired
			si.State, si.LastUsed = StateNew, s.lastUsed
		case s.box != nil:
			si.State, si.LastUsed = StateLive, s.lastUsed
			si.Unsaved = m.hib != nil && s.hib.dirty
		default:
			si.State, si.LastUsed = StateNew, s.lastUsed
			if !si.Saved.IsZero() && !s.hib.failed {
				si.State = StateHibernated // on disk, not yet resumed
			}
		}
		s.mu.Unlock()
		byName[k.name] = si
	}
	m.mu.Unlock()
	out := make([]SessionInfo, 0, len(byName))
	for _, si := range byName {
		out = append(out, si)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// isLive reports whether the principal's session is in memory with state
// that is not only on disk (it has a box, or will start a new one).
func (m *Manager) isLive(principal, name string) bool {
	m.mu.Lock()
	s, ok := m.sessions[key{principal, name}]
	m.mu.Unlock()
	if !ok {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.asleep()
}

// liveCounts counts the live sessions, not hibernated ones, in all and of
// principal, leaving out except. Call it with m.mu held.
func (m *Manager) liveCounts(principal string, except *Session) (total, owned int) {
	for k, s := range m.sessions {
		if s == except {
			continue
		}
		s.mu.Lock()
		asleep := s.asleep()
		s.mu.Unlock()
		if asleep {
			continue
		}
		total++
		if k.principal == principal {
			owned++
		}
	}
	return total, owned
}

// quotaFor is the error for one more live session of principal, or nil.
// Call it with m.mu held.
func (m *Manager) quotaFor(principal string, except *Session) error {
	total, owned := m.liveCounts(principal, except)
	if total >= m.opts.MaxSessions {
		return &QuotaError{Limit: m.opts.MaxSessions, Flag: "max-sessions"}
	}
	if owned >= m.opts.MaxSessionsPerPrincipal {
		return &QuotaError{Limit: m.opts.MaxSessionsPerPrincipal, Principal: true, Flag: "max-sessions-per-principal"}
	}
	return nil
}

// reapEvery is how often the reaper looks at the sessions.
func (m *Manager) reapEvery() time.Duration {
	d := min(m.opts.IdleTTL/4, time.Minute)
	if h := m.hib; h != nil {
		d = min(d, h.opts.After/4)
		if h.opts.CheckpointEvery > 0 {
			d = min(d, h.opts.CheckpointEvery/4)
		}
	}
	return max(d, 10*time.Millisecond)
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
	h.expire(m.isLive)
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

// hibernate saves an idle session and destroys its box, if the session's
// turn is free; the next call resumes it.
func (m *Manager) hibernate(s *Session) {
	select {
	case <-s.turn:
	default:
		return // a call is running; it is not idle after all
	}
	defer func() { s.turn <- struct{}{} }() // not release: hibernating is not a use
	s.mu.Lock()
	box, busy := s.box, s.job != nil || s.closed
	s.mu.Unlock()
	if busy || box == nil || !alive(box) {
		return
	}
	ctx, cancel := m.saveContext()
	defer cancel()
	info, err := m.hib.save(ctx, s.principal, s.name, box, m.isLive)
	if err != nil {
		m.log.Warn("could not hibernate an idle session; it stays live until --idle-ttl", "session", s.name, "principal", s.principal, "err", err)
		s.mu.Lock()
		s.hib.failed = true
		s.mu.Unlock()
		return
	}
	s.mu.Lock()
	if s.box == box {
		s.box = nil
	}
	s.hib = hibState{hibernated: true, mark: time.Now()}
	s.mu.Unlock()
	box.Close()
	m.log.Info("session hibernated", "session", s.name, "principal", s.principal, "bytes", info.Bytes, "took", info.Took, "dropped", len(info.Dropped))
	m.observeSession(event.SessionHibernate, s)
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
		m.saveLive(s)
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
		m.saveLive(s)
	}
	if !m.hib.goSave(run) {
		done() // the shutdown saves it
	}
}

// saveLive snapshots a live session's box, which keeps running. Call it on
// the session's turn.
func (m *Manager) saveLive(s *Session) {
	s.mu.Lock()
	box, busy := s.box, s.job != nil || s.closed
	s.mu.Unlock()
	if busy || box == nil || !alive(box) {
		return
	}
	ctx, cancel := m.saveContext()
	defer cancel()
	start := time.Now()
	info, err := m.hib.save(ctx, s.principal, s.name, box, m.isLive)
	if err != nil { // not retried until the next call
		m.log.Warn("could not checkpoint a session", "session", s.name, "principal", s.principal, "err", err)
		s.mu.Lock()
		s.hib.failed = true
		s.mu.Unlock()
		return
	}
	s.mu.Lock()
	s.hib.mark, s.hib.dirty = start, false
	s.mu.Unlock()
	m.log.Debug("session checkpointed", "session", s.name, "principal", s.principal, "bytes", info.Bytes, "took", time.Since(start))
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
	info, err := m.hib.save(ctx, s.principal, s.name, box, func(string, string) bool { return true })
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
func (s *Session) resume(ctx context.Context) (box sandbox.Sandbox, note string, err error) {
	m, h := s.m, s.m.hib
	snap, err := h.latest(s.principal, s.name)
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
			h.remove(s.principal, s.name)
		}
		s.clearHibernated()
		return nil, fmt.Sprintf("this session's saved state could not be read (%v); %s: %s", err, msgNewBox, m.survived(true, true)), nil
	}
	s.mu.Lock()
	asleep := s.asleep()
	s.mu.Unlock()
	if asleep { // it leaves the hibernated, uncounted sessions
		m.mu.Lock()
		err := m.quotaFor(s.principal, s)
		m.mu.Unlock()
		if err != nil {
			return nil, "", err
		}
	}
	start := time.Now()
	box, dropped, err := m.restoreBox(ctx, snap.dir)
	took := time.Since(start)
	if err != nil {
		if errors.Is(err, ErrBusy) || ctx.Err() != nil {
			return nil, "", err
		}
		m.log.Warn("could not resume a saved session; starting a fresh sandbox", "session", s.name, "principal", s.principal, "err", err)
		h.remove(s.principal, s.name)
		s.clearHibernated()
		return nil, fmt.Sprintf("this session's saved state could not be restored (%v); %s: %s", err, msgNewBox, m.survived(true, true)), nil
	}
	s.mu.Lock()
	s.hib = hibState{mark: snap.saved}
	s.mu.Unlock()
	m.log.Info("session resumed", "session", s.name, "principal", s.principal, "took", took, "saved", snap.saved)
	m.observeSession(event.SessionResume, s)
	note = fmt.Sprintf("resumed this session from hibernation in %s (saved %s ago): its variables and workspace files are as they were; processes that were running in it were not kept",
		took.Round(time.Millisecond), time.Since(snap.saved).Round(time.Second))
	if len(dropped) > 0 {
		note += fmt.Sprintf("; not restored: %s", strings.Join(dropped[:min(len(dropped), 10)], "; "))
		if len(dropped) > 10 {
			note += fmt.Sprintf(" and %d more", len(dropped)-10)
		}
	}
	return box, note, nil
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
	_, err := m.hib.latest(principal, name)
	return err == nil
}

// forgetSaved drops the session's saved state: it was reset, or its box
// was lost and the session starts over.
func (m *Manager) forgetSaved(principal, name string) bool {
	if m.hib == nil {
		return false
	}
	return m.hib.remove(principal, name)
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
func (s *Session) fromSaved(ctx context.Context, lost string) (box sandbox.Sandbox, note string, err error) {
	if lost != "" {
		s.m.forgetSaved(s.principal, s.name)
		return nil, lost, nil
	}
	box, note, err = s.resume(ctx)
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
