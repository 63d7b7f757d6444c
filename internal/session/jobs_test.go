package session_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// pollDone polls a job until it ends, gathering what the polls returned
// while it ran.
func pollDone(t *testing.T, j *session.Job) (session.JobStatus, string) {
	t.Helper()
	var live strings.Builder
	deadline := time.Now().Add(2 * liveness)
	for time.Now().Before(deadline) {
		st := j.Poll(context.Background(), time.Second)
		live.WriteString(st.Output)
		if st.Done {
			return st, live.String()
		}
	}
	t.Fatalf("job %s did not end", j.ID())
	return session.JobStatus{}, ""
}

// TestJobOutputThenResult: a job's polls return its output as it comes,
// then its result as a foreground call would have; what it left in the
// kernel stays for the session's next call.
func TestJobOutputThenResult(t *testing.T) {
	mgr, _ := withPython(t, session.Options{})
	s := getSession(t, mgr, "bg")
	j, err := s.Start(context.Background(), session.Python,
		"import time\nfor i in range(4):\n    print('line', i, flush=True); time.sleep(0.6)\nleft = 42\n'done'", 0)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(j.ID(), "job-") || j.Session() != "bg" {
		t.Errorf("job %q in session %q", j.ID(), j.Session())
	}
	first := j.Poll(context.Background(), 0)
	if first.Done {
		t.Fatal("the job was done at once")
	}
	st, live := pollDone(t, j)
	if !strings.Contains(live, "line 1") {
		t.Errorf("the polls while it ran returned %q, without line 1", first.Output+live)
	}
	if st.Err != nil || st.Outcome == nil {
		t.Fatalf("result: %v %+v", st.Err, st.Outcome)
	}
	if got := st.Outcome.Stdout.Text; !strings.Contains(got, "line 0") || !strings.Contains(got, "line 3") || st.Outcome.Result["text/plain"] != "'done'" {
		t.Errorf("result: stdout %q, value %v", got, st.Outcome.Result)
	}
	if st.Outcome.Session != "bg" {
		t.Errorf("result names session %q", st.Outcome.Session)
	}
	out, err := s.RunPython(context.Background(), "left", liveness)
	if err != nil || out.Result["text/plain"] != "42" {
		t.Errorf("after the job: %v %+v", err, out)
	}
	// Polling again returns the same result (a client that lost it).
	if again := j.Poll(context.Background(), 0); !again.Done || again.Outcome != st.Outcome {
		t.Errorf("second poll of the ended job: %+v", again)
	}
}

// TestJobBusySession: while a job runs, its session's other calls are
// refused at once with an error naming the job; another session runs.
func TestJobBusySession(t *testing.T) {
	mgr, _ := withPython(t, session.Options{})
	s := getSession(t, mgr, "busy")
	j, err := s.Start(context.Background(), session.Python, "import time; time.sleep(3)", 0)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = s.RunPython(context.Background(), "1", liveness)
	var be *session.JobBusyError
	if !errors.As(err, &be) || be.Job != j.ID() || !strings.Contains(err.Error(), j.ID()) || !strings.Contains(err.Error(), "cancel_job") {
		t.Fatalf("a call during the job: %v", err)
	}
	if time.Since(start) > 2*time.Second {
		t.Errorf("the refusal waited %s for the job", time.Since(start))
	}
	if err := s.WithBox(context.Background(), func(sandbox.Sandbox) error { return nil }); !errors.Is(err, session.ErrJobBusy) {
		t.Errorf("a file call during the job: %v", err)
	}
	if _, err := s.Start(context.Background(), session.Python, "1", 0); !errors.Is(err, session.ErrJobBusy) {
		t.Errorf("a second job in the session: %v", err)
	}
	other := getSession(t, mgr, "other")
	if out, err := other.RunPython(context.Background(), "2+2", liveness); err != nil || out.Result["text/plain"] != "4" {
		t.Errorf("another session: %v %+v", err, out)
	}
	if st, _ := pollDone(t, j); st.Err != nil {
		t.Fatal(st.Err)
	}
	if out, err := s.RunPython(context.Background(), "3", liveness); err != nil || out.Result["text/plain"] != "3" {
		t.Errorf("after the job: %v %+v", err, out)
	}
}

// TestJobCancel: cancel interrupts the job as a time limit would; the
// result says it was cancelled, and the session's state is kept.
func TestJobCancel(t *testing.T) {
	mgr, _ := withPython(t, session.Options{Grace: 5 * time.Second})
	s := getSession(t, mgr, "c")
	if _, err := s.RunPython(context.Background(), "kept = 7", liveness); err != nil {
		t.Fatal(err)
	}
	j, err := s.Start(context.Background(), session.Python, "import time\nwhile True: time.sleep(0.1)", 0)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), liveness)
	defer cancel()
	st := j.Cancel(ctx)
	if !st.Done || st.Err != nil || st.Outcome == nil {
		t.Fatalf("cancel: %+v", st)
	}
	if !st.Outcome.TimedOut || !strings.Contains(st.Outcome.Note, "cancel_job") || !strings.Contains(st.Outcome.Note, "state is kept") {
		t.Errorf("cancelled result: timed out %v, note %q", st.Outcome.TimedOut, st.Outcome.Note)
	}
	if out, err := s.RunPython(context.Background(), "kept", liveness); err != nil || out.Result["text/plain"] != "7" {
		t.Errorf("after cancel: %v %+v", err, out)
	}
}

// TestJobTimeLimit: a job runs under --max-job-time, not the call limit,
// and is stopped at it with a note naming it.
func TestJobTimeLimit(t *testing.T) {
	mgr, _ := withPython(t, session.Options{MaxTimeout: 100 * time.Millisecond, Jobs: session.JobOptions{MaxTime: 1500 * time.Millisecond}})
	if d := mgr.JobTimeout(3600); d != 1500*time.Millisecond {
		t.Errorf("JobTimeout(3600) = %s", d)
	}
	s := getSession(t, mgr, "t")
	j, err := s.Start(context.Background(), session.Python, "import time; time.sleep(0.5); print('past the call limit')\nwhile True: pass", mgr.JobTimeout(0))
	if err != nil {
		t.Fatal(err)
	}
	st, _ := pollDone(t, j)
	if st.Err != nil || !strings.Contains(st.Outcome.Stdout.Text, "past the call limit") {
		t.Fatalf("result: %v %+v", st.Err, st.Outcome)
	}
	if !st.Outcome.TimedOut || !strings.Contains(st.Outcome.Note, "time limit of 1.5s") {
		t.Errorf("note %q", st.Outcome.Note)
	}
}

// TestJobOwnedByPrincipal: another principal cannot find a job, as if it
// never existed.
func TestJobOwnedByPrincipal(t *testing.T) {
	mgr, _ := withPython(t, session.Options{})
	s, err := mgr.Get("alice", "a")
	if err != nil {
		t.Fatal(err)
	}
	j, err := s.Start(context.Background(), session.Python, "1", 0)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := mgr.Job("alice", j.ID()); err != nil || got != j {
		t.Errorf("the owner's lookup: %v", err)
	}
	if _, err := mgr.Job("bob", j.ID()); !errors.Is(err, session.ErrNoJob) {
		t.Errorf("another principal's lookup: %v", err)
	}
	if ids := mgr.Jobs("bob"); len(ids) != 0 {
		t.Errorf("bob lists %v", ids)
	}
	pollDone(t, j)
}

// TestJobQuota: a principal holds a bounded number of jobs; past it a
// start is refused with a clear error, and a collected job makes room.
// The cap is one principal's: another starts.
func TestJobQuota(t *testing.T) {
	mgr, _ := withPython(t, session.Options{Jobs: session.JobOptions{PerPrincipal: 2}})
	var jobs []*session.Job
	for _, name := range []string{"q1", "q2"} {
		j, err := getSession(t, mgr, name).Start(context.Background(), session.Python, "1", 0)
		if err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, j)
	}
	for _, j := range jobs {
		<-waitDone(j)
	}
	q3 := getSession(t, mgr, "q3")
	_, err := q3.Start(context.Background(), session.Python, "1", 0)
	var qe *session.JobQuotaError
	if !errors.As(err, &qe) || !strings.Contains(err.Error(), "2 background jobs") {
		t.Fatalf("third job: %v", err)
	}
	other, _ := mgr.Get("bob", "b")
	if _, err := other.Start(context.Background(), session.Python, "1", 0); err != nil {
		t.Errorf("another principal's job: %v", err)
	}
	if st := jobs[0].Poll(context.Background(), 0); !st.Done {
		t.Fatal("not done")
	}
	j, err := q3.Start(context.Background(), session.Python, "1", 0)
	if err != nil {
		t.Fatalf("after collecting one: %v", err)
	}
	if _, err := mgr.Job("local", jobs[0].ID()); !errors.Is(err, session.ErrNoJob) {
		t.Errorf("the collected job that made room is still there: %v", err)
	}
	pollDone(t, j)
}

// TestJobRetention: a finished job is forgotten after the retention.
func TestJobRetention(t *testing.T) {
	mgr, _ := withPython(t, session.Options{Jobs: session.JobOptions{Retention: 200 * time.Millisecond}})
	j, err := getSession(t, mgr, "r").Start(context.Background(), session.Python, "1", 0)
	if err != nil {
		t.Fatal(err)
	}
	<-waitDone(j)
	if _, err := mgr.Job("local", j.ID()); err != nil {
		t.Fatalf("just ended: %v", err)
	}
	waitUntil(t, func() bool { _, err := mgr.Job("local", j.ID()); return errors.Is(err, session.ErrNoJob) }, "the job to be forgotten")
}

// TestJobOutlivesIdleTTL: a session running a job is not idle, however
// long the job runs.
func TestJobOutlivesIdleTTL(t *testing.T) {
	mgr, _ := withPython(t, session.Options{IdleTTL: 100 * time.Millisecond})
	s := getSession(t, mgr, "long")
	j, err := s.Start(context.Background(), session.Python, "import time; time.sleep(1.5); 'survived'", 0)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := pollDone(t, j)
	if st.Err != nil || st.Outcome.Result["text/plain"] != "'survived'" {
		t.Fatalf("the job in a session past its idle TTL: %v %+v", st.Err, st.Outcome)
	}
}

// TestJobShutdown: closing the manager ends every job, and their results
// say why.
func TestJobShutdown(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	mgr := session.NewManager(session.Options{Backend: b})
	s, _ := mgr.Get("local", "s")
	j, err := s.Start(context.Background(), session.Python, "import time\nwhile True: time.sleep(0.1)", 0)
	if err != nil {
		t.Fatal(err)
	}
	finishes(t, "closing the manager", mgr.Close)
	if !j.Done() {
		t.Fatal("the job outlived the manager")
	}
	st := j.Poll(context.Background(), 0)
	if st.Outcome != nil && !strings.Contains(st.Outcome.Note, "shutting down") {
		t.Errorf("result: %+v", st.Outcome)
	}
	if st.Outcome == nil && !errors.Is(st.Err, session.ErrShutdown) {
		t.Errorf("error: %v", st.Err)
	}
	if n := b.Live(); n != 0 {
		t.Errorf("%d boxes outlive the manager", n)
	}
	if _, err := mgr.Job("local", j.ID()); err != nil {
		t.Logf("after close: %v", err)
	}
}

// TestJobPerCall: in per-call mode a job runs in a box of its own, and
// the files it wrote come back with its result.
func TestJobPerCall(t *testing.T) {
	mgr, b := withPython(t, session.Options{Mode: session.ModePerCall})
	j, err := mgr.StartOnce(context.Background(), "local", session.Shell, "sleep 0.3; echo made > out.txt; echo ok", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := pollDone(t, j)
	if st.Err != nil || !strings.Contains(st.Outcome.Stdout.Text, "ok") {
		t.Fatalf("%v %+v", st.Err, st.Outcome)
	}
	if len(st.Produced) != 1 || st.Produced[0].Path != "out.txt" || string(st.Produced[0].Data) != "made\n" {
		t.Errorf("produced %+v", st.Produced)
	}
	waitUntil(t, func() bool { return b.Live() == 0 }, "the job's box to be destroyed")
}

func waitDone(j *session.Job) <-chan struct{} {
	c := make(chan struct{})
	go func() {
		defer close(c)
		for !j.Done() {
			time.Sleep(10 * time.Millisecond)
		}
	}()
	return c
}

// TestJobStartBusy: a job that cannot get a box is refused at its start,
// as a foreground call would be, and leaves no job behind.
func TestJobStartBusy(t *testing.T) {
	mgr, _ := withPython(t, session.Options{MaxBoxes: 1, BoxWait: 100 * time.Millisecond})
	if _, err := getSession(t, mgr, "holder").RunPython(context.Background(), "1", liveness); err != nil {
		t.Fatal(err)
	}
	if _, err := getSession(t, mgr, "late").Start(context.Background(), session.Python, "1", 0); !errors.Is(err, session.ErrBusy) {
		t.Fatalf("a job with every box taken: %v", err)
	}
	if ids := mgr.Jobs("local"); len(ids) != 0 {
		t.Errorf("the refused job is listed: %v", ids)
	}
}

// TestJobObserved: a job's execution reaches the observer (the audit log
// and the metrics) like a foreground call's, in both modes, with its
// principal.
func TestJobObserved(t *testing.T) {
	for _, mode := range []session.Mode{session.ModeSession, session.ModePerCall} {
		t.Run(string(mode), func(t *testing.T) {
			rec := &recorder{}
			mgr, _ := withPython(t, session.Options{Mode: mode, Observer: rec})
			var (
				j   *session.Job
				err error
			)
			if mode == session.ModePerCall {
				j, err = mgr.StartOnce(context.Background(), "alice", session.Shell, "echo job-ran", nil, 0)
			} else {
				s, _ := mgr.Get("alice", "obs")
				j, err = s.Start(context.Background(), session.Shell, "echo job-ran", 0)
			}
			if err != nil {
				t.Fatal(err)
			}
			pollDone(t, j)
			waitUntil(t, func() bool { return len(rec.execs()) == 1 }, "the job's execution event")
			e := rec.execs()[0]
			if e.Principal != "alice" || e.Code != "echo job-ran" || e.Language != "shell" || e.Result != "ok" {
				t.Errorf("event %+v", e)
			}
		})
	}
}

// Finished jobs nobody polls hold at most --jobs-memory-per-principal of
// results per principal and --jobs-memory in all: past them the oldest
// results are cut to a summary, which the poll says, and keeps the exit
// code and the ends of each stream.
func TestJobResultsBounded(t *testing.T) {
	const stream, per, all = 512 << 10, 4 << 20, 6 << 20
	mgr, _ := inProcess(t, session.Options{Mode: session.ModePerCall, MaxOutput: stream,
		Jobs: session.JobOptions{MaxBytesPerPrincipal: per, MaxBytes: all}})
	ctx := context.Background()
	start := func(principal string, i int) *session.Job {
		code := fmt.Sprintf("echo first-%d; head -c %d /dev/zero | tr '\\0' o; head -c %d /dev/zero | tr '\\0' e >&2; echo last-%d; exit 3", i, stream, stream, i)
		j, err := mgr.StartOnce(ctx, principal, session.Shell, code, nil, liveness)
		if err != nil {
			t.Fatal(err)
		}
		waitUntil(t, j.Done, "a job to end")
		return j
	}
	var first, last *session.Job
	for i := range 12 { // 12 MiB of results
		j := start("a", i)
		if i == 0 {
			first = j
		}
		last = j
	}
	if n := mgr.HeldJobBytes("a"); n > per {
		t.Errorf("one principal's unpolled jobs hold %d bytes, over its bound of %d", n, per)
	}
	for i := range 6 {
		start("b", i)
	}
	if n := mgr.HeldJobBytes(""); n > all {
		t.Errorf("unpolled jobs hold %d bytes, over the bound of %d", n, all)
	}
	st := last.Poll(ctx, 0)
	if st.Outcome == nil || st.Outcome.Stdout.Total < stream || len(st.Outcome.Stdout.Text) < stream {
		t.Errorf("the newest job's result was cut: %+v", st.Outcome)
	}
	st = first.Poll(ctx, 0)
	if st.Outcome == nil {
		t.Fatalf("the oldest job's result: %v", st.Err)
	}
	o := st.Outcome
	if o.ExitCode != 3 || !strings.Contains(o.Stdout.Text, "first-0") || !strings.Contains(o.Stdout.Text, "last-0") ||
		o.Stdout.Total < stream || !strings.Contains(o.Note, "--jobs-memory") {
		t.Errorf("the oldest job's cut result: exit %d, %d of %d bytes of stdout, note %q", o.ExitCode, len(o.Stdout.Text), o.Stdout.Total, o.Note)
	}
}

// Summaries count too: once every result is cut and the bound is still
// passed (many principals, each with a few jobs), the oldest finished
// jobs are forgotten, as at the end of --job-retention.
func TestJobSummariesBounded(t *testing.T) {
	const stream, all = 64 << 10, 40 << 10
	mgr, _ := inProcess(t, session.Options{Mode: session.ModePerCall, MaxOutput: stream,
		Jobs: session.JobOptions{MaxBytes: all}})
	ctx := context.Background()
	var first string
	for i := range 8 {
		j, err := mgr.StartOnce(ctx, fmt.Sprint("p", i), session.Shell, fmt.Sprintf("head -c %d /dev/zero | tr '\\0' o", stream), nil, liveness)
		if err != nil {
			t.Fatal(err)
		}
		waitUntil(t, j.Done, "a job to end")
		if i == 0 {
			first = j.ID()
		}
	}
	if n := mgr.HeldJobBytes(""); n > all {
		t.Errorf("finished jobs hold %d bytes of summaries, over the bound of %d", n, all)
	}
	if _, err := mgr.Job("p0", first); !errors.Is(err, session.ErrNoJob) {
		t.Errorf("the oldest job, past the bound with every result cut: %v", err)
	}
}
