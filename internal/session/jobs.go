package session

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"
	"unicode/utf8"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// Background jobs: a run call that returns at once with a handle, runs
// under its own longer limit in its session's box (or a per-call box),
// and is followed with Poll and stopped with Cancel. A job belongs to
// the principal that started it; no other principal can find it.
//
// While a job runs, its session's turn is free but every other call of
// the session is refused with a JobBusyError naming the job, so that a
// client is told at once rather than left waiting for up to an hour.

// JobOptions bound background jobs. Zero values mean defaults.
type JobOptions struct {
	// MaxTime is a job's time limit, and the most a job may ask for
	// (DefaultMaxJobTime).
	MaxTime time.Duration
	// Retention is how long a finished job's result is kept
	// (DefaultJobRetention).
	Retention time.Duration
	// PerPrincipal caps the jobs one principal holds, running or finished
	// and kept (DefaultJobsPerPrincipal).
	PerPrincipal int
	// MaxBytes bounds the results finished jobs hold in memory, of all
	// principals together (DefaultJobBytes), and MaxBytesPerPrincipal
	// those of one principal (DefaultJobBytesPerPrincipal). Past them, the
	// oldest results are cut to a summary: those already collected first.
	MaxBytes, MaxBytesPerPrincipal int64
}

// Defaults of JobOptions.
const (
	DefaultMaxJobTime       = time.Hour
	DefaultJobRetention     = 15 * time.Minute
	DefaultJobsPerPrincipal = 32
	// A job's result holds up to 2×MaxOutput of streams (kiln's
	// --keep-output is 4 MiB), agentproto.MaxRich of rich output and, in
	// per-call mode, 4 MiB of files: about 16 MiB.
	DefaultJobBytes             = 256 << 20
	DefaultJobBytesPerPrincipal = 64 << 20
)

func (o *JobOptions) defaults() {
	if o.MaxTime <= 0 {
		o.MaxTime = DefaultMaxJobTime
	}
	if o.Retention <= 0 {
		o.Retention = DefaultJobRetention
	}
	if o.PerPrincipal <= 0 {
		o.PerPrincipal = DefaultJobsPerPrincipal
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultJobBytes
	}
	if o.MaxBytesPerPrincipal <= 0 {
		o.MaxBytesPerPrincipal = min(DefaultJobBytesPerPrincipal, o.MaxBytes)
	}
}

// maxPending bounds the output a job keeps between two polls: the newest
// bytes are kept, and a poll says how many were dropped. A poll that is
// waiting returns early once half of it is used, so a client polling
// with a long wait loses nothing it could have had.
const maxPending = 16 << 10

// Errors of jobs a client can act on.
var (
	// ErrNoJob is a job id that names no job of the caller's: never
	// started, started by another principal, or finished and forgotten.
	ErrNoJob = errors.New("no such job")
	// ErrJobBusy matches JobBusyError.
	ErrJobBusy = errors.New("the session is running a background job")
	// ErrJobQuota matches JobQuotaError.
	ErrJobQuota = errors.New("too many background jobs")
)

// JobBusyError is a call refused because its session runs a job.
type JobBusyError struct{ Job, Session string }

func (e *JobBusyError) Error() string {
	return fmt.Sprintf("session %q is busy running background job %s; nothing ran. Follow it with job_status(job=%q), stop it with cancel_job(job=%q), or run this in another session (a new \"session\" name)",
		e.Session, e.Job, e.Job, e.Job)
}

func (e *JobBusyError) Is(target error) bool { return target == ErrJobBusy }

// JobQuotaError is a job refused because its principal holds the most
// jobs it may.
type JobQuotaError struct {
	Limit     int
	Retention time.Duration
}

func (e *JobQuotaError) Error() string {
	return fmt.Sprintf("you already hold %d background jobs, running or finished in the last %s, the most one client may hold; nothing ran. Collect finished jobs' results with job_status (a collected job makes room), cancel_job one you no longer need, or run in the foreground",
		e.Limit, e.Retention)
}

func (e *JobQuotaError) Is(target error) bool { return target == ErrJobQuota }

// stopReason is the cause of a job's context: runBounded says it in the
// result instead of "the client cancelled the call".
type stopReason string

func (r stopReason) Error() string { return string(r) }

const (
	stopCancelled stopReason = "the job was cancelled (cancel_job)"
	stopShutdown  stopReason = "kiln is shutting down, which cancels running jobs"
)

// Job is one background run.
type Job struct {
	id        string
	principal string
	session   string // "" in per-call mode
	started   time.Time
	cancel    context.CancelCauseFunc
	done      chan struct{} // closed when the result is in

	mu      sync.Mutex
	pending []byte // output since the last poll, the newest maxPending bytes
	dropped int64  // bytes of output since the last poll not in pending
	seen    int64  // output bytes the box has reported
	full    chan struct{}
	// The result, once done is closed.
	out       *Outcome
	produced  []Produced
	err       error
	finished  time.Time
	collected bool // a poll has returned the result
	// held is what the result counts against the bounds on finished
	// jobs (guarded by the table's mu); cut says it was summarized.
	held int64
	cut  bool
}

// ID is the job's handle, as the client passes it back.
func (j *Job) ID() string { return j.id }

// Done reports whether the job has ended.
func (j *Job) Done() bool {
	select {
	case <-j.done:
		return true
	default:
		return false
	}
}

// Session names the session the job runs in ("" in per-call mode).
func (j *Job) Session() string { return j.session }

// update takes a live output report of the box. It is called on the
// reader of the box's frames and never blocks. Reports come from the box
// and are hostile: a total that does not grow is ignored.
func (j *Job) update(o agentproto.Output) {
	j.mu.Lock()
	defer j.mu.Unlock()
	n := o.Total - j.seen
	if n <= 0 {
		return
	}
	j.seen = o.Total
	tail := o.Tail
	if n < int64(len(tail)) {
		tail = tail[len(tail)-int(n):]
		for len(tail) > 0 && !utf8.RuneStart(tail[0]) {
			tail = tail[1:]
		}
	} else {
		j.dropped += n - int64(len(tail)) // written between two reports
	}
	j.pending = append(j.pending, tail...)
	if over := len(j.pending) - maxPending; over > 0 {
		for over < len(j.pending) && !utf8.RuneStart(j.pending[over]) {
			over++
		}
		j.dropped += int64(over)
		j.pending = append(j.pending[:0], j.pending[over:]...)
	}
	if len(j.pending) >= maxPending/2 {
		select {
		case j.full <- struct{}{}:
		default:
		}
	}
}

func (j *Job) finish(out *Outcome, produced []Produced, err error) {
	j.mu.Lock()
	j.out, j.produced, j.err, j.finished = out, produced, err, time.Now()
	j.mu.Unlock()
	close(j.done)
}

// JobStatus is what a poll of a job returns.
type JobStatus struct {
	ID, Session string
	Elapsed     time.Duration // since the job started, or its whole run once done
	// Output is what the job wrote (stdout and stderr as they
	// interleaved) since the last poll; Dropped counts the bytes of it
	// that are not in Output.
	Output  string
	Dropped int64
	Done    bool
	// Once Done: the job's result, as a foreground call would have
	// returned it.
	Outcome  *Outcome
	Produced []Produced
	Err      error
}

// Poll returns the job's output since the last poll. It waits up to wait
// for the job to end (or for its unread output to fill half of what a
// job keeps), and returns the result once the job is done.
func (j *Job) Poll(ctx context.Context, wait time.Duration) JobStatus {
	if wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-j.done:
		case <-j.full:
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	st := JobStatus{ID: j.id, Session: j.session, Elapsed: time.Since(j.started)}
	select {
	case <-j.done:
		st.Done, st.Outcome, st.Produced, st.Err = true, j.out, j.produced, j.err
		st.Elapsed = j.finished.Sub(j.started)
		j.collected = true
	default:
		st.Output, st.Dropped = string(j.pending), j.dropped
		j.pending, j.dropped = j.pending[:0], 0
		select { // the poll took what filled it
		case <-j.full:
		default:
		}
	}
	return st
}

// Peek returns the newest of the output the next poll will return (at
// most n bytes, whole characters) and the time since the job started,
// without taking the output.
func (j *Job) Peek(n int) (string, time.Duration) {
	j.mu.Lock()
	defer j.mu.Unlock()
	out := j.pending[max(len(j.pending)-n, 0):]
	for len(out) > 0 && !utf8.RuneStart(out[0]) {
		out = out[1:]
	}
	return string(out), time.Since(j.started)
}

// Cancel interrupts the job and, if it does not stop within the grace
// period, destroys its box, as the time limit does. It waits for the
// job to end (or ctx), and returns its final status. A job that has
// already ended is left as it is.
func (j *Job) Cancel(ctx context.Context) JobStatus {
	select {
	case <-j.done:
	default:
		j.cancel(stopCancelled)
		select {
		case <-j.done:
		case <-ctx.Done():
		}
	}
	return j.Poll(ctx, 0)
}

// jobTable holds every principal's jobs.
type jobTable struct {
	mu   sync.Mutex
	byID map[string]*Job
	// held counts the bytes of finished jobs' results, by principal and
	// in all (heldAll).
	held    map[string]int64
	heldAll int64
	closed  bool
	base    context.Context // parent of every job's context; cancelled on Close
	stop    context.CancelCauseFunc
	wg      sync.WaitGroup
}

func (t *jobTable) init() {
	t.byID = make(map[string]*Job)
	t.held = make(map[string]int64)
	t.base, t.stop = context.WithCancelCause(context.Background())
}

func (t *jobTable) cancelAll() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.stop(stopShutdown)
}

func (t *jobTable) wait() { t.wg.Wait() }

func (t *jobTable) isClosed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}

// expire forgets finished jobs older than the retention. Call with t.mu held.
func (t *jobTable) expire(retention time.Duration) {
	for _, j := range t.byID {
		select {
		case <-j.done:
		default:
			continue
		}
		j.mu.Lock()
		old := time.Since(j.finished) > retention
		j.mu.Unlock()
		if old {
			t.forget(j)
		}
	}
}

// forget removes a job from the table. Call with t.mu held.
func (t *jobTable) forget(j *Job) {
	delete(t.byID, j.id)
	t.count(j, -j.held)
}

// count adds n to what j's result holds. Call with t.mu held.
func (t *jobTable) count(j *Job, n int64) {
	if n == 0 {
		return
	}
	j.held += n
	t.heldAll += n
	if t.held[j.principal] += n; t.held[j.principal] == 0 {
		delete(t.held, j.principal)
	}
}

// newJob registers a job of principal, under the principal's cap: when
// the principal is at the cap, the oldest finished job whose result a
// poll has already returned makes room; if there is none, the job is
// refused.
//
// The job's context is the server's, not the request's, which ends when
// the request does; it carries what of the request governs its box: the
// Offline mark.
func (m *Manager) newJob(req context.Context, principal, sessionName string) (*Job, context.Context, error) {
	t := &m.jobs
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, nil, ErrShutdown
	}
	t.expire(m.opts.Jobs.Retention)
	var mine, collected []*Job
	for _, j := range t.byID {
		if j.principal != principal {
			continue
		}
		mine = append(mine, j)
		j.mu.Lock()
		if j.collected {
			collected = append(collected, j)
		}
		j.mu.Unlock()
	}
	if len(mine) >= m.opts.Jobs.PerPrincipal {
		if len(collected) == 0 {
			return nil, nil, &JobQuotaError{Limit: m.opts.Jobs.PerPrincipal, Retention: m.opts.Jobs.Retention}
		}
		sort.Slice(collected, func(a, b int) bool { return collected[a].finished.Before(collected[b].finished) })
		t.forget(collected[0])
	}
	var raw [9]byte
	rand.Read(raw[:])
	j := &Job{
		id: "job-" + hex.EncodeToString(raw[:]), principal: principal, session: sessionName,
		started: time.Now(), done: make(chan struct{}), full: make(chan struct{}, 1),
	}
	ctx, cancel := context.WithCancelCause(t.base)
	j.cancel = cancel
	ctx = sandbox.WithOutput(ctx, j.update)
	ctx = withNetOf(ctx, req)
	t.byID[j.id] = j
	t.wg.Add(1)
	return j, ctx, nil
}

// forgetJob removes a job that could not start, ending it with err for
// whoever already holds it.
func (m *Manager) forgetJob(j *Job, err error) {
	m.jobs.mu.Lock()
	m.jobs.forget(j)
	m.jobs.mu.Unlock()
	j.cancel(nil)
	j.finish(nil, nil, err)
	m.jobs.wg.Done()
}

// Job finds the principal's job by its id. Another principal's job is
// not found, exactly as one that never existed.
func (m *Manager) Job(principal, id string) (*Job, error) {
	t := &m.jobs
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(m.opts.Jobs.Retention)
	j, ok := t.byID[id]
	if !ok || j.principal != principal {
		return nil, ErrNoJob
	}
	return j, nil
}

// Jobs lists the ids of the principal's jobs, oldest first.
func (m *Manager) Jobs(principal string) []string {
	t := &m.jobs
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(m.opts.Jobs.Retention)
	var mine []*Job
	for _, j := range t.byID {
		if j.principal == principal {
			mine = append(mine, j)
		}
	}
	sort.Slice(mine, func(a, b int) bool { return mine[a].started.Before(mine[b].started) })
	ids := make([]string, len(mine))
	for i, j := range mine {
		ids[i] = j.id
	}
	return ids
}

// JobTimeout clamps a job's requested time limit in seconds (0: the
// most a job may run).
func (m *Manager) JobTimeout(seconds float64) time.Duration {
	if seconds <= 0 {
		return m.opts.Jobs.MaxTime
	}
	return min(time.Duration(seconds*float64(time.Second)), m.opts.Jobs.MaxTime)
}

// jobBusy is the error for a call of the session while its job runs;
// nil if none runs.
func (s *Session) jobBusy() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.job == nil {
		return nil
	}
	return &JobBusyError{Job: s.job.id, Session: s.name}
}

// Start runs code as a background job in the session's box and returns
// at once; ctx bounds only the start (taking the session's turn and a
// box); a timeout of 0 is the most a job may run. The job runs until it ends, its timeout, Cancel, a reset of the
// session or the server's shutdown.
func (s *Session) Start(ctx context.Context, lang Language, code string, timeout time.Duration) (*Job, error) {
	if err := s.acquire(ctx); err != nil {
		return nil, err
	}
	if timeout <= 0 {
		timeout = s.m.opts.Jobs.MaxTime
	}
	j, jctx, err := s.m.newJob(ctx, s.principal, s.name)
	if err != nil {
		s.release()
		return nil, err
	}
	box, fresh, note, err := s.ensure(ctx)
	if err != nil {
		s.m.forgetJob(j, err)
		s.release()
		return nil, err
	}
	s.mu.Lock()
	s.job = j
	s.mu.Unlock()
	s.release()
	s.m.log.Info("job started", "job", j.id, "session", s.name, "principal", s.principal, "timeout", timeout)
	go func() {
		defer s.m.jobs.wg.Done()
		out, err := s.m.runBounded(jctx, box, timeout, execFunc(lang, code, s.m.opts.MaxOutput))
		// The session's bookkeeping after a call is done on its turn.
		turn := false
		select {
		case <-s.turn:
			turn = true
		case <-s.closing:
		}
		if s.isClosed() { // a reset or the shutdown destroyed its box
			out, err = nil, ErrReset
			if s.m.jobs.isClosed() {
				err = ErrShutdown
			}
		} else {
			s.settle(box, out, err, fresh, note)
		}
		s.mu.Lock()
		if s.job == j {
			s.job = nil
		}
		s.mu.Unlock()
		if turn {
			s.release()
		}
		s.m.finishJob(j, out, nil, err)
		s.m.observeExec(jctx, s.principal, s.name, lang, code, out, err)
		s.m.log.Info("job ended", "job", j.id, "session", s.name, "err", err)
	}()
	return j, nil
}

// StartOnce runs code as a background job in a never-used box
// (per-call mode), which is destroyed when the job ends; the files the
// job wrote come back with its result.
func (m *Manager) StartOnce(ctx context.Context, principal string, lang Language, code string, files map[string][]byte, timeout time.Duration) (*Job, error) {
	if timeout <= 0 {
		timeout = m.opts.Jobs.MaxTime
	}
	j, jctx, err := m.newJob(ctx, principal, "")
	if err != nil {
		return nil, err
	}
	m.log.Info("job started", "job", j.id, "principal", principal, "timeout", timeout)
	go func() {
		defer m.jobs.wg.Done()
		out, produced, err := m.RunOnce(WithPrincipal(jctx, principal), lang, code, files, timeout)
		m.finishJob(j, out, produced, err)
		m.log.Info("job ended", "job", j.id, "err", err)
	}()
	return j, nil
}

func execFunc(lang Language, code string, maxOutput int) runFunc {
	return func(ctx context.Context, box sandbox.Sandbox) (*agentproto.ExecResult, error) {
		if lang == Shell {
			return box.RunShell(ctx, code, sandbox.ExecOptions{MaxOutput: maxOutput})
		}
		return box.RunPython(ctx, code, sandbox.ExecOptions{MaxOutput: maxOutput})
	}
}

// finishJob records a job's result, then keeps what finished jobs hold
// within JobOptions.MaxBytesPerPrincipal and MaxBytes: a result a client
// has not polled yet is held outside every other bound on the server's
// memory (about 16 MiB at most each), so past them the oldest results are
// cut to a summary, those already collected first.
func (m *Manager) finishJob(j *Job, out *Outcome, produced []Produced, err error) {
	j.finish(out, produced, err)
	t := &m.jobs
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.byID[j.id] != j { // forgotten meanwhile
		return
	}
	t.count(j, resultBytes(out, produced))
	o := m.opts.Jobs
	t.bound(j.principal, func() int64 { return t.held[j.principal] - o.MaxBytesPerPrincipal })
	t.bound("", func() int64 { return t.heldAll - o.MaxBytes })
}

// bound cuts the results of principal's finished jobs ("": everyone's),
// collected ones first, then the oldest, until over() is no longer
// positive, and then forgets them in the same order. Call with t.mu held.
func (t *jobTable) bound(principal string, over func() int64) {
	if over() <= 0 {
		return
	}
	type candidate struct {
		j         *Job
		collected bool
		finished  time.Time
	}
	var cands []candidate
	for _, j := range t.byID {
		if principal != "" && j.principal != principal || j.held == 0 {
			continue
		}
		j.mu.Lock()
		cands = append(cands, candidate{j, j.collected, j.finished})
		j.mu.Unlock()
	}
	sort.Slice(cands, func(a, b int) bool {
		if cands[a].collected != cands[b].collected {
			return cands[a].collected
		}
		return cands[a].finished.Before(cands[b].finished)
	})
	for _, c := range cands {
		if over() <= 0 {
			return
		}
		if !c.j.cut {
			t.cut(c.j)
		}
	}
	// Summaries count too (many principals with a few jobs each): past
	// the bound with every result cut, the oldest jobs are forgotten, as
	// at the end of the retention.
	for _, c := range cands {
		if over() <= 0 {
			return
		}
		t.forget(c.j)
	}
}

// cutKeep is the bytes of each end of each stream a cut result keeps.
const cutKeep = 4 << 10

// msgJobCut is the note of a result cut to its summary.
const msgJobCut = "this job's result was cut before it was collected, to keep the results kiln holds for finished jobs within --jobs-memory-per-principal and --jobs-memory: only the first and last %d bytes of each stream are kept, and its images and files are gone. Collect a job's result with job_status soon after it ends, or have the job write what it makes to files"

// cut replaces j's result by a summary: its exit status, error and
// notes, and the ends of its streams. A poll that already returned the
// result keeps it: the summary is a new value. Call with t.mu held.
func (t *jobTable) cut(j *Job) {
	j.mu.Lock()
	j.out, j.produced = cutOutcome(j.out), cutProduced(j.produced)
	n := resultBytes(j.out, j.produced)
	j.mu.Unlock()
	j.cut = true
	t.count(j, n-j.held)
}

func cutOutcome(out *Outcome) *Outcome {
	if out == nil {
		return nil
	}
	c := *out
	c.Note = joinNote(out.Note, fmt.Sprintf(msgJobCut, cutKeep))
	if out.ExecResult != nil {
		r := *out.ExecResult
		r.Stdout, r.Stderr = cutStream(r.Stdout), cutStream(r.Stderr)
		r.Result, r.Displays = nil, nil
		if v, ok := out.Result["text/plain"]; ok && len(v) <= cutKeep {
			r.Result = agentproto.MimeBundle{"text/plain": v}
		}
		c.ExecResult = &r
	}
	return &c
}

// cutStream keeps the first and last cutKeep bytes of a stream's text,
// in whole characters; its Total still counts every byte.
func cutStream(st agentproto.Stream) agentproto.Stream {
	if len(st.Text) <= 2*cutKeep {
		return st
	}
	head, tail := cutKeep, len(st.Text)-cutKeep
	for head > 0 && !utf8.RuneStart(st.Text[head]) {
		head--
	}
	for tail < len(st.Text) && !utf8.RuneStart(st.Text[tail]) {
		tail++
	}
	return agentproto.Stream{Text: st.Text[:head] + st.Text[tail:], Total: st.Total, Cut: head}
}

func cutProduced(produced []Produced) []Produced {
	if produced == nil {
		return nil
	}
	out := make([]Produced, len(produced))
	for i, p := range produced {
		if p.Data != nil {
			p.Data, p.Skipped = nil, "not kept: the job's result was cut before it was collected (--jobs-memory)"
		}
		out[i] = p
	}
	return out
}

// resultBytes is about what a job's result holds in memory.
func resultBytes(out *Outcome, produced []Produced) int64 {
	var n int
	for _, p := range produced {
		n += len(p.Path) + len(p.Data) + len(p.Skipped) + 64
	}
	if out == nil {
		return int64(n)
	}
	n += len(out.Note) + len(out.Session)
	for _, f := range out.Files {
		n += len(f.Path) + len(f.Special) + 64
	}
	if r := out.ExecResult; r != nil {
		n += len(r.Stdout.Text) + len(r.Stderr.Text) + len(r.Signal)
		for _, b := range append([]agentproto.MimeBundle{r.Result}, r.Displays...) {
			for k, v := range b {
				n += len(k) + len(v)
			}
		}
		if e := r.Error; e != nil {
			n += len(e.Name) + len(e.Value) + len(e.Traceback)
		}
		for _, note := range r.Notes {
			n += len(note)
		}
	}
	return int64(n)
}
