// Package session owns kiln's sandboxes on behalf of clients: named
// sessions scoped to a principal, per-call mode, the warm pool, timeouts,
// idle expiry and teardown.
package session

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"runtime/debug"
	"sync"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/event"
	"kiln/internal/sandbox"
)

// Mode says whether state persists between calls.
type Mode string

const (
	ModeSession Mode = "session"  // a session keeps its sandbox across calls
	ModePerCall Mode = "per-call" // every call gets a never-used sandbox
)

// Options configure a Manager. Zero values mean defaults.
type Options struct {
	Backend sandbox.Backend
	Mode    Mode
	Limits  sandbox.Limits
	Preload []string
	// DefaultTimeout applies when a call names none; MaxTimeout caps what
	// a call may ask for.
	DefaultTimeout, MaxTimeout time.Duration
	// Grace is how long an interrupted call may take to stop before its
	// sandbox is destroyed.
	Grace   time.Duration
	IdleTTL time.Duration
	// MaxSessions caps live sessions across all principals
	// (DefaultMaxSessions); MaxSessionsPerPrincipal caps those of one
	// principal (DefaultMaxSessionsPerPrincipal), so one client cannot take
	// every session.
	MaxSessions, MaxSessionsPerPrincipal int
	// MaxBoxes caps live boxes: sessions' boxes, per-call boxes and the
	// pool's, each counted until it is destroyed (default: DefaultMaxBoxes).
	// A call that finds every box taken waits up to BoxWait
	// (DefaultBoxWait) for one, then gets ErrBusy.
	MaxBoxes    int
	BoxWait     time.Duration
	MaxOutput   int // bytes kept per stream
	PoolSize    int
	PoolWorkers int
	Logger      *slog.Logger
	// Jobs bounds background jobs (jobs.go).
	Jobs JobOptions
	// Snapshots configure fork, snapshot and rollback (snapshot.go).
	Snapshots SnapshotOptions
	// Observer is told of every execution, session change and box
	// creation (the audit log, the metrics); nil: no one.
	Observer event.Observer
	// Hibernate saves idle sessions to disk instead of dropping them
	// (hibernate.go); off without a Dir, and in per-call mode.
	Hibernate HibernateOptions
	// StateQuota caps the bytes on disk of every principal's snapshots
	// and hibernated sessions together (DefaultStateQuota): each
	// principal's own quotas bound nothing in all when every OIDC subject
	// is a new principal (store.go).
	StateQuota int64
	// Ledger holds MaxSessionsPerPrincipal across every server that shares
	// it (ledger.go); nil: this server counts its own.
	Ledger Ledger
}

// Defaults of Options; kiln's flags default to them too.
const (
	DefaultTimeout                 = 30 * time.Second
	DefaultMaxTimeout              = 5 * time.Minute
	DefaultIdleTTL                 = 30 * time.Minute
	DefaultMaxSessions             = 32
	DefaultMaxSessionsPerPrincipal = 8
	DefaultBoxWait                 = 15 * time.Second
)

func (o *Options) defaults() {
	if o.Mode == "" {
		o.Mode = ModeSession
	}
	if o.DefaultTimeout == 0 {
		o.DefaultTimeout = DefaultTimeout
	}
	if o.MaxTimeout == 0 {
		o.MaxTimeout = DefaultMaxTimeout
	}
	if o.DefaultTimeout > o.MaxTimeout {
		o.DefaultTimeout = o.MaxTimeout
	}
	if o.Grace == 0 {
		o.Grace = 2 * time.Second
	}
	if o.IdleTTL == 0 {
		o.IdleTTL = DefaultIdleTTL
	}
	if o.MaxSessions == 0 {
		o.MaxSessions = DefaultMaxSessions
	}
	if o.MaxSessionsPerPrincipal == 0 {
		o.MaxSessionsPerPrincipal = min(DefaultMaxSessionsPerPrincipal, o.MaxSessions)
	}
	if o.BoxWait == 0 {
		o.BoxWait = DefaultBoxWait
	}
	if o.MaxOutput == 0 {
		o.MaxOutput = agentproto.DefaultMaxOutput
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	o.Limits = o.Limits.WithDefaults()
	if o.MaxBoxes == 0 {
		o.MaxBoxes = DefaultMaxBoxes(o.Limits)
	}
	o.Jobs.defaults()
	if o.Hibernate.Dir != "" {
		o.Hibernate.defaults()
	}
	o.Snapshots.defaults()
	if o.StateQuota <= 0 {
		o.StateQuota = DefaultStateQuota
	}
}

// Errors a client can act on.
var (
	ErrBadName     = errors.New("session names are 1-64 letters, digits, '.', '_' or '-'")
	ErrTooMany     = errors.New("too many live sessions; reset_session one you no longer need")
	ErrBusy        = errors.New("kiln is at its limit of live sandboxes; retry in a little while")
	ErrPerCallMode = errors.New("this server runs in per-call mode: nothing persists between calls")
	ErrShutdown    = errors.New("kiln is shutting down")
)

// QuotaError is a refused new session: which limit was reached, and the
// flag that sets it. It matches ErrTooMany.
type QuotaError struct {
	Limit     int
	Principal bool   // the principal's own quota, not the server's
	Flag      string // the kiln flag that sets the limit
	// Cluster: the principal's sessions across every front of the cluster
	// (Options.Ledger) reached it; Held of them are live.
	Cluster bool
	Held    int
}

func (e *QuotaError) Error() string {
	if e.Cluster {
		return fmt.Sprintf("you already have %s across this kiln cluster's servers, and one client may hold %d (--%s); reset_session one you no longer need, or continue in an existing one", liveSessions(e.Held), e.Limit, e.Flag)
	}
	if e.Principal {
		return fmt.Sprintf("you already have %s, the most one client may hold (--%s); reset_session one you no longer need, or continue in an existing one", liveSessions(e.Limit), e.Flag)
	}
	return fmt.Sprintf("kiln already holds %s, the most it allows across all clients (--%s); reset_session one you no longer need, or retry later", liveSessions(e.Limit), e.Flag)
}

func liveSessions(n int) string {
	if n == 1 {
		return "1 live session"
	}
	return fmt.Sprintf("%d live sessions", n)
}

func (e *QuotaError) Is(target error) bool { return target == ErrTooMany }

// BusyError is a call that found every sandbox kiln may run in use and
// none came free in time. It matches ErrBusy.
type BusyError struct {
	Max  int
	Wait time.Duration
	Mode Mode
}

func (e *BusyError) Error() string {
	msg := fmt.Sprintf("kiln is busy: it is at its limit of %d live sandboxes (--max-boxes) and none came free within %s. Nothing ran; retry the call in a little while", e.Max, e.Wait.Round(time.Millisecond))
	if e.Mode == ModeSession {
		msg += ", or reset_session a session you no longer need"
	}
	return msg + "."
}

func (e *BusyError) Is(target error) bool { return target == ErrBusy }

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// ValidName reports whether a client-chosen session name is acceptable.
func ValidName(name string) bool { return nameRE.MatchString(name) }

type key struct{ principal, name string }

// Manager holds the sessions of every principal.
type Manager struct {
	opts  Options
	log   *slog.Logger
	pool  *Pool
	slots *slots // the cap on live boxes

	mu       sync.Mutex
	sessions map[key]*Session
	calls    map[sandbox.Sandbox]struct{} // per-call boxes in use
	closed   bool
	stop     chan struct{}
	wg       sync.WaitGroup
	// destroying counts per-call boxes being destroyed after their call.
	destroying sync.WaitGroup
	// admitting counts the sessions being admitted by the Ledger, which
	// are live for it.
	admitting map[key]int
	jobs      jobTable    // background jobs (jobs.go)
	saves     storeOnce   // snapshots and hibernated sessions (store.go)
	hib       *hibernator // nil: sessions are not saved (hibernate.go)
}

// NewManager starts the pool and the idle reaper.
func NewManager(opts Options) *Manager {
	opts.defaults()
	m := &Manager{
		opts:      opts,
		log:       opts.Logger,
		sessions:  make(map[key]*Session),
		calls:     make(map[sandbox.Sandbox]struct{}),
		stop:      make(chan struct{}),
		admitting: map[key]int{},
	}
	if opts.Ledger != nil {
		opts.Ledger.Bind(m.liveNames)
	}
	spec := sandbox.Spec{Limits: opts.Limits, Preload: opts.Preload}
	m.slots = newSlots(opts.MaxBoxes)
	m.pool = newPool(opts.Backend, spec, PoolOptions{Size: opts.PoolSize, Concurrency: opts.PoolWorkers, Logger: opts.Logger, Observer: opts.Observer}, m.slots)
	m.warnOvercommit()
	m.jobs.init()
	if opts.Hibernate.Dir != "" && opts.Mode == ModeSession {
		if st, err := m.store(); err != nil {
			m.log.Error("sessions will not be hibernated", "err", err)
		} else {
			m.hib = &hibernator{opts: opts.Hibernate, st: st}
			if opts.Hibernate.Shared != nil {
				m.hib.sh = newSharer(opts.Hibernate.Shared, st)
			}
		}
	}
	m.wg.Add(1)
	go m.reap()
	return m
}

// Options returns the effective options (defaults filled in).
func (m *Manager) Options() Options { return m.opts }

// Timeout clamps a requested timeout in seconds (0: the default).
func (m *Manager) Timeout(seconds float64) time.Duration {
	if seconds <= 0 {
		return m.opts.DefaultTimeout
	}
	d := time.Duration(seconds * float64(time.Second))
	return min(d, m.opts.MaxTimeout)
}

// Get returns the principal's session called name, creating it.
func (m *Manager) Get(principal, name string) (*Session, error) {
	if m.opts.Mode == ModePerCall {
		return nil, ErrPerCallMode
	}
	if !ValidName(name) {
		return nil, ErrBadName
	}
	var created *Session // reported once the lock is released (deferred calls run last in, first out)
	defer func() {
		if created != nil {
			m.observeSession(event.SessionCreate, created)
		}
	}()
	k := key{principal, name}
	var admitted func() // the Ledger counted the session
	defer func() {
		if admitted != nil {
			admitted()
		}
	}()
	for {
		m.mu.Lock()
		if m.closed {
			m.mu.Unlock()
			return nil, ErrShutdown
		}
		if s, ok := m.sessions[k]; ok {
			m.mu.Unlock()
			return s, nil
		}
		if err := m.quotaFor(principal, nil); err != nil {
			m.mu.Unlock()
			if admitted != nil { // the ledger counts it: count it out
				admitted()
				admitted = nil
				m.ledgerSync(principal)
			}
			return nil, err
		}
		if admitted != nil || m.opts.Ledger == nil {
			s := newSession(m, principal, name)
			m.sessions[k] = s
			m.mu.Unlock()
			created = s
			return s, nil
		}
		m.mu.Unlock()
		// The cluster's count, outside the lock; then the local checks
		// again, since another call may have made the session meanwhile.
		done, err := m.admit(principal, name)
		if err != nil {
			return nil, err
		}
		admitted = done
	}
}

// LiveBoxes is the number of boxes that exist right now: in sessions, in
// per-call calls, in the pool, or still being destroyed.
func (m *Manager) LiveBoxes() int { return m.slots.inUse() }

// getBox takes a fresh box under the cap on live boxes, cut off from the
// network first when ctx is Offline (before any state is loaded into it).
func (m *Manager) getBox(ctx context.Context) (sandbox.Sandbox, error) {
	box, err := m.pool.get(ctx, m.opts.BoxWait)
	if errors.Is(err, errNoSlot) {
		m.log.Warn("refused a call: every sandbox is in use", "max_boxes", m.opts.MaxBoxes, "waited", m.opts.BoxWait)
		return nil, &BusyError{Max: m.opts.MaxBoxes, Wait: m.opts.BoxWait, Mode: m.opts.Mode}
	}
	if err != nil {
		return nil, err
	}
	return cutOrClose(ctx, box)
}

// Reset destroys the principal's session called name, if it exists. It
// never waits for a call running in the session: that call is cut off and
// its box destroyed.
func (m *Manager) Reset(principal, name string) bool {
	m.mu.Lock()
	s, ok := m.sessions[key{principal, name}]
	delete(m.sessions, key{principal, name})
	m.mu.Unlock()
	if ok {
		m.observeSession(event.SessionReset, s)
		s.close()
		m.ledgerSync(principal)
	}
	saved := m.forgetSaved(principal, name)
	return ok || saved
}

// Close destroys every session and the pool.
func (m *Manager) Close() {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	m.closed = true
	all := m.sessions
	m.sessions = map[key]*Session{}
	// Per-call boxes still in use are destroyed under their calls, which
	// then fail: a call stuck on a box that stopped answering must not
	// keep it alive.
	for box := range m.calls {
		m.destroying.Add(1)
		go func() { defer m.destroying.Done(); box.Close() }()
	}
	m.mu.Unlock()
	m.jobs.cancelAll() // jobs end as their boxes are destroyed below
	close(m.stop)
	m.wg.Wait()
	if m.hib != nil {
		m.hibernateAll(all)
	}
	var wg sync.WaitGroup
	for _, s := range all {
		m.observeSession(event.SessionClose, s)
		wg.Add(1)
		go func() { defer wg.Done(); m.release(s); s.close() }()
	}
	wg.Wait()
	m.pool.Close()
	m.destroying.Wait()
	m.jobs.wait()
	m.saves.close()
}

// Outcome is what one call produced, with what kiln did about it.
type Outcome struct {
	*agentproto.ExecResult
	Session  string        // the session it ran in ("" in per-call mode)
	Duration time.Duration // wall time of the call
	TimedOut bool
	// Restarted is true when the sandbox was destroyed (timeout that did
	// not stop, the box died): the session's state is gone.
	Restarted bool
	// Fresh is true when this call started a new sandbox for the session.
	Fresh bool
	Note  string // what kiln did, for the model
	Files []agentproto.FileInfo

	obs outcomeClass // for the observer
	// hits are the box's limit counters at the call's end (hitsRead: they
	// were read), for the session to keep without reading them again.
	hits     *sandbox.LimitHits
	hitsRead bool
}

// Session is one named sandbox lifetime: its box is created on first use
// and replaced after a reset or a crash.
type Session struct {
	m         *Manager
	principal string
	name      string

	// turn serializes calls (a one-token channel, so a waiting call can
	// give up when its client leaves or the session is reset).
	turn chan struct{}
	// closing is closed by close: calls waiting for their turn give up,
	// and the running one is cut off by destroying its box.
	closing chan struct{}

	mu       sync.Mutex // guards box, closed, lastUsed, lost, hits, hostGone, hib; never held across a call
	box      sandbox.Sandbox
	lastUsed time.Time
	closed   bool
	// lost says why kiln destroyed the box after the last call, for the
	// next one ("" if it did not).
	lost string
	// hits are the box's limit counters after its last call, to tell what
	// killed it between calls (nil: not counted).
	hits *sandbox.LimitHits
	// hostGone says the last call's box went with its host (a kiln
	// node): the next call resumes from the session's last save.
	hostGone bool
	// job is the background job running in the box; while it runs, the
	// session's other calls are refused (jobs.go).
	job *Job
	hib hibState // its state saved on disk (hibernate.go)
}

func newSession(m *Manager, principal, name string) *Session {
	s := &Session{m: m, principal: principal, name: name, lastUsed: time.Now(),
		turn: make(chan struct{}, 1), closing: make(chan struct{})}
	s.turn <- struct{}{}
	return s
}

// Name is the session's name, as the model passes it back.
func (s *Session) Name() string { return s.name }

// ErrReset is a call cut off, or refused, because its session was reset.
var ErrReset = errors.New("the session was reset while this call waited or ran; call again to start a fresh sandbox")

// acquire waits for the session's turn, the client leaving, or a reset.
func (s *Session) acquire(ctx context.Context) error {
	select {
	case <-s.turn:
	case <-ctx.Done():
		return ctx.Err()
	case <-s.closing:
		return ErrReset
	}
	if s.isClosed() {
		s.release()
		return ErrReset
	}
	if err := s.jobBusy(); err != nil {
		s.release()
		return err
	}
	return nil
}

func (s *Session) release() {
	s.mu.Lock()
	s.lastUsed = time.Now()
	s.mu.Unlock()
	s.turn <- struct{}{}
}

func (s *Session) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

func (s *Session) idleSince(ttl time.Duration) bool {
	select {
	case <-s.turn:
	default:
		return false // a call is running
	}
	defer func() { s.turn <- struct{}{} }()
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.job == nil && time.Since(s.lastUsed) > ttl
}

// close destroys the session's box without waiting for its turn: a call
// stuck on a box that no longer answers must not keep the box alive. The
// box's Close kills it without a word to its agent; the stuck call then
// fails.
func (s *Session) close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	close(s.closing)
	box := s.box
	s.box = nil
	s.mu.Unlock()
	if box != nil {
		box.Close()
	}
}

// drop forgets the session's box if it is still box, destroying it.
func (s *Session) drop(box sandbox.Sandbox) {
	s.mu.Lock()
	if s.box == box {
		s.box = nil
	}
	s.mu.Unlock()
	box.Close()
}

// ensure returns the session's live box, replacing a dead one. Call it on
// the session's turn.
func (s *Session) ensure(ctx context.Context) (box sandbox.Sandbox, fresh bool, note string, err error) {
	s.mu.Lock()
	box, lost, before, hostGone := s.box, s.lost, s.hits, s.hostGone
	s.lost, s.hits, s.hostGone = "", nil, false
	s.mu.Unlock()
	from := fromHibernation
	if hostGone {
		from = fromLastSave
	}
	switch {
	case box != nil && alive(box):
		if err := cutIfOffline(ctx, box); err != nil {
			s.drop(box)
			return nil, false, "", err
		}
		return box, false, "", nil
	case box != nil && hostLost(box) != "":
		// Gone with its host, not of itself: the session's last save is
		// its newest state.
		note = fmt.Sprintf(msgPrevDied, hostLost(box))
		s.drop(box)
		box = nil
		resumed := ""
		if s.m.hib != nil {
			var saved sandbox.Sandbox
			if saved, resumed, err = s.fromCheckpoint(ctx, fromLastSave); err != nil || saved != nil {
				return saved, false, joinNote(note, resumed), err
			}
		}
		if resumed == "" {
			resumed = msgNewBox + ": " + s.m.survived(true, true)
		}
		note = joinNote(note, resumed)
	case box != nil:
		if lost = faultReason(box); lost == "" {
			lost = fmt.Sprintf(msgPrevDied, s.m.diedReason(box, delta(before, hits(box))))
		}
		s.drop(box)
		note = lost + "; " + msgNewBox + ": " + s.m.survived(true, true)
	case lost != "":
		note = lost + "; " + msgNewBox + ": " + s.m.survived(true, true)
	}
	// A live box another replica holds is the session's newest state;
	// a hibernated one comes next.
	if box = s.m.adopt(ctx, s); box != nil {
		note = ""
	} else {
		if s.m.hib != nil {
			var saved sandbox.Sandbox
			if saved, note, err = s.fromSaved(ctx, note, from); err != nil || saved != nil {
				return saved, false, note, err
			}
		}
		if box, err = s.m.getBox(ctx); err == nil {
			s.m.bind(ctx, s, box)
			fresh = true
		}
	}
	if err != nil {
		if errors.Is(err, ErrBusy) {
			return nil, false, note, err
		}
		return nil, false, note, fmt.Errorf("starting sandbox: %w", err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		box.Close()
		return nil, false, note, ErrReset
	}
	s.box = box
	s.mu.Unlock()
	return box, fresh, note, nil
}

// RunPython runs a cell in the session's kernel.
func (s *Session) RunPython(ctx context.Context, code string, timeout time.Duration) (*Outcome, error) {
	out, err := s.exec(ctx, timeout, func(ctx context.Context, box sandbox.Sandbox) (*agentproto.ExecResult, error) {
		return box.RunPython(ctx, code, sandbox.ExecOptions{MaxOutput: s.m.opts.MaxOutput})
	})
	s.m.observeExec(ctx, s.principal, s.name, Python, code, out, err)
	return out, err
}

// RunShell runs a bash command in the session's workspace.
func (s *Session) RunShell(ctx context.Context, command string, timeout time.Duration) (*Outcome, error) {
	out, err := s.exec(ctx, timeout, func(ctx context.Context, box sandbox.Sandbox) (*agentproto.ExecResult, error) {
		return box.RunShell(ctx, command, sandbox.ExecOptions{MaxOutput: s.m.opts.MaxOutput})
	})
	s.m.observeExec(ctx, s.principal, s.name, Shell, command, out, err)
	return out, err
}

func (s *Session) exec(ctx context.Context, timeout time.Duration, run runFunc) (*Outcome, error) {
	if err := s.acquire(ctx); err != nil {
		return nil, err
	}
	defer s.release()
	box, fresh, note, err := s.ensure(ctx)
	if err != nil {
		return nil, err
	}
	out, err := s.m.runBounded(ctx, box, timeout, run)
	if s.isClosed() {
		return nil, ErrReset // its box was destroyed under it
	}
	s.settle(box, out, err, fresh, note)
	return out, err
}

// WithBox runs f on the session's box (file operations). A reset of the
// session destroys the box under f, which then fails.
func (s *Session) WithBox(ctx context.Context, f func(sandbox.Sandbox) error) error {
	if err := s.acquire(ctx); err != nil {
		return err
	}
	defer s.release()
	box, _, _, err := s.ensure(ctx)
	if err != nil {
		return err
	}
	err = f(box)
	if s.isClosed() {
		return ErrReset
	}
	s.after(box, err)
	s.touched()
	return err
}

// after records, on the session's turn, what the next call must know of
// box after a call that ended with err: why kiln destroyed it, or its
// limit counters to tell later what killed it.
// settle records how a call on box ended: the box's health, the session
// and note the outcome carries, and the box dropped if the call lost it.
func (s *Session) settle(box sandbox.Sandbox, out *Outcome, err error, fresh bool, note string) {
	if out != nil && out.hitsRead {
		s.afterHits(box, err, out.hits)
	} else {
		s.after(box, err)
	}
	s.touched()
	if out == nil {
		return
	}
	out.Session, out.Fresh = s.name, fresh
	if note != "" {
		out.Note = joinNote(note, out.Note)
	}
	if out.Restarted {
		// The note said the state is gone; so it must be, saves too,
		// unless the box went with its host: then its last save is the
		// session's newest state, and the next call resumes it.
		if hostLost(box) == "" {
			s.m.forgetSaved(s.principal, s.name)
		} else {
			s.mu.Lock()
			s.hostGone = true
			s.mu.Unlock()
		}
		s.drop(box)
	}
}

func (s *Session) after(box sandbox.Sandbox, err error) { s.afterHits(box, err, hits(box)) }

// afterHits is after with the box's limit counters read already (h: the
// reading at the end of the call; on the cluster each is a round trip to
// the node).
func (s *Session) afterHits(box sandbox.Sandbox, err error, h *sandbox.LimitHits) {
	lost := ""
	// A box kiln faulted on was closed, but may not be done dying yet.
	if err != nil && (!alive(box) || errors.Is(err, errFaulted)) {
		lost = lostReason(err)
	}
	s.mu.Lock()
	s.lost, s.hits = lost, h
	if lost != "" && s.box == box {
		s.box = nil
	}
	s.mu.Unlock()
	if lost != "" {
		box.Close()
	}
}

// errFaulted is a call on whose path kiln itself panicked (faultError):
// its box was destroyed, and the session must not use it again, whether
// or not the box has finished dying by the next call.
var errFaulted = errors.New("kiln faulted running the call")

type faultError struct{ v any }

func (e faultError) Error() string {
	return fmt.Sprintf("kiln faulted running the call (%v); its sandbox was destroyed", e.v)
}

func (e faultError) Is(target error) bool { return target == errFaulted }

type runFunc func(context.Context, sandbox.Sandbox) (*agentproto.ExecResult, error)

type runResult struct {
	res *agentproto.ExecResult
	err error
}

// runBounded runs one call under the timeout: at the deadline (or when
// the client goes away) it interrupts; if the call does not stop within
// the grace period the box is destroyed.
func (m *Manager) runBounded(ctx context.Context, box sandbox.Sandbox, timeout time.Duration, run runFunc) (*Outcome, error) {
	start := time.Now()
	before := hits(box)
	// The call's values (a live-output sink) but not its cancellation:
	// the deadline and the client going away interrupt it below.
	callCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	done := make(chan runResult, 1)
	go func() {
		defer func() { // a fault of kiln's on this call's path: see mcpserver's guard
			if v := recover(); v != nil {
				m.log.Error("panic running a call", "panic", v, "stack", string(debug.Stack()))
				box.Close()
				done <- runResult{err: faultError{v}}
			}
		}()
		res, err := run(callCtx, box)
		done <- runResult{res, err}
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()

	finish := func(r runResult) (*Outcome, error) {
		out := &Outcome{ExecResult: r.res, Duration: time.Since(start), obs: outcomeClass{box: box.ID()}}
		out.hits, out.hitsRead = hits(box), true // before Close, which may remove the counters
		d := delta(before, out.hits)
		if r.err != nil {
			if errors.Is(r.err, sandbox.ErrDied) {
				why := m.diedReason(box, d)
				after := m.survived(true, true)
				if hostLost(box) != "" {
					after = m.afterLoss()
				}
				box.Close()
				out.ExecResult = &agentproto.ExecResult{Error: &agentproto.ExecError{
					Name: "SandboxDied", Value: why,
				}}
				out.Restarted = true
				out.Note = why + "; " + after
				out.obs.died(box, d)
				return out, nil
			}
			var ae *sandbox.AgentError
			if errors.As(r.err, &ae) {
				return nil, ae
			}
			return nil, r.err
		}
		m.explainLimits(out, box, d)
		out.obs.finished(out.ExecResult, box, d, m.opts.Limits)
		return out, nil
	}

	var why string
	select {
	case r := <-done:
		out, err := finish(r)
		if rr, ok := box.(sandbox.RefusalReporter); ok && out != nil {
			seen := map[string]bool{}
			for _, refusal := range rr.NetworkRefusals() {
				if !seen[refusal] {
					seen[refusal] = true
					out.Note = joinNote(out.Note, refusal)
				}
			}
		}
		return out, err
	case <-timer.C:
		why = fmt.Sprintf(msgTime, limitSeconds(timeout))
	case <-ctx.Done():
		why = msgCancel
		var stop stopReason // a job cancelled or cut off by shutdown
		if errors.As(context.Cause(ctx), &stop) {
			why = string(stop)
		}
	}
	ictx, icancel := context.WithTimeout(context.Background(), m.opts.Grace)
	box.Interrupt(ictx)
	icancel()
	select {
	case r := <-done:
		out, err := finish(r)
		if out != nil {
			out.TimedOut = true
			out.obs.interrupted(why == msgCancel)
			note := fmt.Sprintf(msgInterrupted, why)
			if !out.Restarted {
				note = joinNote(note, m.survived(false, false))
			}
			out.Note = joinNote(note, out.Note)
		}
		return out, err
	case <-time.After(m.opts.Grace):
	}
	box.Close()
	cancel()
	m.log.Info("destroyed a sandbox that did not stop", "reason", why)
	out := &Outcome{
		ExecResult: &agentproto.ExecResult{Error: &agentproto.ExecError{Name: "Timeout", Value: why}},
		Duration:   time.Since(start),
		TimedOut:   true,
		Restarted:  true,
		Note:       joinNote(fmt.Sprintf(msgNotStopped, why), m.survived(true, true)),
		obs:        outcomeClass{box: box.ID()},
	}
	out.obs.interrupted(why == msgCancel)
	return out, nil
}

func joinNote(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "; " + b
}
