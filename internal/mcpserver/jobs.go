package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/session"
)

// Background jobs through tools: run_python/run_shell with background:
// true, job_status and cancel_job. (The MCP tasks extension would carry
// the same jobs; docs/tools.md says why kiln does not serve it.)

// maxJobWait caps job_status's wait_s, so that a client whose requests
// time out after 60 s (the TypeScript SDK's default) is always answered.
const maxJobWait = 50 * time.Second

type (
	JobStatusArgs struct {
		Job   string  `json:"job" jsonschema:"the job handle a background run returned"`
		WaitS float64 `json:"wait_s,omitempty" jsonschema:"seconds to wait for the job to finish before answering (at most 50); omit to answer at once"`
	}
	CancelJobArgs struct {
		Job string `json:"job" jsonschema:"the job handle a background run returned"`
	}
)

func (s *Server) addJobTools() {
	ro := true
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:  "job_status",
		Title: "Follow a background job",
		Description: fmt.Sprintf("Follow a background job started by run_python or run_shell with background: true. Returns the output the job wrote since the last job_status call while it runs, and once it is done its full result, exactly as the run call would have returned it (output, images, errors). wait_s (at most %g) waits for the job to finish before answering, returning as soon as it does; without it the answer is immediate. A job's result is kept for %s after it ends; only the client that started a job can see it.",
			maxJobWait.Seconds(), s.mgr.Options().Jobs.Retention),
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: ro, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.jobStatus, noSession[JobStatusArgs]))
	destructive := true
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "cancel_job",
		Title:       "Cancel a background job",
		Description: "Stop a background job: it is interrupted (KeyboardInterrupt in Python, SIGINT in the shell) and, if it does not stop within a moment, its sandbox is destroyed, as at a time limit. Returns the job's result, which says which happened and what of the session survived.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: &destructive, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.cancelJob, noSession[CancelJobArgs]))
}

// noSession is for guard: a job tool names no session to destroy.
func noSession[In any](In) string { return "" }

// describeBackground is the sentence of the run tools on background jobs.
func (s *Server) describeBackground() string {
	o := s.mgr.Options().Jobs
	where := "in the session's sandbox; while it runs, every other call in that session (run, file tools) is refused at once with a \"busy\" error naming the job, so use another session meanwhile, or reset_session to cut the job off"
	if s.perCall() {
		where = "in a fresh sandbox of its own, and the files it wrote come back with its result"
	}
	return fmt.Sprintf(" For work longer than you want to wait, pass background: true: the call returns at once with a job handle; follow the job with job_status and stop it with cancel_job. A job's time limit is timeout_s, up to %s (the default). It runs %s.",
		o.MaxTime, where)
}

func jobError(err error) bool {
	return errors.Is(err, session.ErrJobBusy) || errors.Is(err, session.ErrJobQuota) || errors.Is(err, session.ErrNoJob)
}

func (s *Server) startJob(ctx context.Context, req *mcp.CallToolRequest, lang session.Language, code, name string, timeoutS float64, files map[string]string) (*mcp.CallToolResult, any, error) {
	if bad := checkRun(lang, code, timeoutS); bad != nil {
		return bad, nil, nil
	}
	timeout := s.mgr.JobTimeout(timeoutS)
	log := s.log.With("principal", principal(req), "tool", req.Params.Name)
	var (
		job *session.Job
		err error
	)
	if s.perCall() {
		if name != "" {
			return toolError("this server runs every call in a fresh sandbox (per-call mode); there are no sessions, so omit \"session\""), nil, nil
		}
		staged, derr := decodeFiles(files)
		if derr != nil {
			return toolError("%v", derr), nil, nil
		}
		job, err = s.mgr.StartOnce(ctx, principal(req), lang, code, staged, timeout)
	} else {
		if len(files) > 0 {
			return toolError("\"files\" is for per-call mode; in a session, use write_file"), nil, nil
		}
		sess, serr := s.session(req, name)
		if serr != nil {
			return toolError("%v", serr), nil, nil
		}
		job, err = sess.Start(ctx, lang, code, timeout)
	}
	if err != nil {
		return s.failure(log, err), nil, nil
	}
	var b strings.Builder
	fmt.Fprintf(&b, "[job: %s", job.ID())
	if job.Session() != "" {
		fmt.Fprintf(&b, ", session: %s", job.Session())
	}
	fmt.Fprintf(&b, "] started in the background, time limit %s.\n", limitText(timeout))
	fmt.Fprintf(&b, "Follow it with job_status(job=%q, wait_s=%g); stop it with cancel_job(job=%q).", job.ID(), maxJobWait.Seconds(), job.ID())
	if job.Session() != "" {
		fmt.Fprintf(&b, " Until it ends, session %q refuses other calls.", job.Session())
	}
	sc := map[string]any{"job": job.ID(), "state": "running", "time_limit_s": timeout.Seconds()}
	if job.Session() != "" {
		sc["session"] = job.Session()
	}
	return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: b.String()}}, StructuredContent: sc}, nil, nil
}

func limitText(d time.Duration) string {
	if d%time.Second == 0 {
		return fmt.Sprintf("%d s", d/time.Second)
	}
	return d.String()
}

// job finds the caller's job, or says why not.
func (s *Server) job(req *mcp.CallToolRequest, id string) (*session.Job, *mcp.CallToolResult) {
	if strings.TrimSpace(id) == "" {
		return nil, toolError("job is empty: pass the job handle a background run returned")
	}
	j, err := s.mgr.Job(principal(req), id)
	if err == nil {
		return j, nil
	}
	msg := fmt.Sprintf("no job %q of yours: it never existed, belongs to another client, or ended more than %s ago and was forgotten", printable(id), s.mgr.Options().Jobs.Retention)
	if ids := s.mgr.Jobs(principal(req)); len(ids) > 0 {
		msg += ". Your jobs: " + strings.Join(ids, ", ")
	}
	return nil, toolError("%s", msg)
}

// printable shortens and quotes what a client sent, for an error.
func printable(s string) string {
	if len(s) > 80 {
		s = s[:80] + "…"
	}
	return strings.ToValidUTF8(s, "?")
}

func (s *Server) jobStatus(ctx context.Context, req *mcp.CallToolRequest, args JobStatusArgs) (*mcp.CallToolResult, any, error) {
	if args.WaitS < 0 {
		return toolError("wait_s must be positive"), nil, nil
	}
	j, bad := s.job(req, args.Job)
	if bad != nil {
		return bad, nil, nil
	}
	wait := min(time.Duration(args.WaitS*float64(time.Second)), maxJobWait)
	stop := s.waitProgress(ctx, req, j, wait)
	st := j.Poll(ctx, wait)
	stop()
	return s.jobResult(req, st, ""), nil, nil
}

// waitProgress sends a progress notification every progressIdle while a
// job_status call waits, if it carries a progress token: the job's time
// running and the newest of its unread output. It keeps the connection
// of a client that resets its timeout on progress alive.
func (s *Server) waitProgress(ctx context.Context, req *mcp.CallToolRequest, j *session.Job, wait time.Duration) (stop func()) {
	if wait <= 0 || req == nil || req.Session == nil || req.Params == nil || req.Params.GetProgressToken() == nil {
		return func() {}
	}
	token := req.Params.GetProgressToken()
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(progressIdle)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			out, elapsed := j.Peek(agentproto.MaxLiveTail)
			msg := fmt.Sprintf("job %s running for %s", j.ID(), elapsed.Round(time.Second))
			if out != "" {
				msg += "; the newest output:\n" + lastLines(out, progressLines)
			}
			req.Session.NotifyProgress(ctx, &mcp.ProgressNotificationParams{ProgressToken: token, Progress: elapsed.Seconds(), Message: msg})
		}
	}()
	return func() { close(quit); <-done }
}

func (s *Server) cancelJob(ctx context.Context, req *mcp.CallToolRequest, args CancelJobArgs) (*mcp.CallToolResult, any, error) {
	j, bad := s.job(req, args.Job)
	if bad != nil {
		return bad, nil, nil
	}
	if j.Done() {
		return s.jobResult(req, j.Poll(ctx, 0), "the job had already ended; nothing was cancelled"), nil, nil
	}
	// The job stops within the grace period, or its box is destroyed;
	// this bounds the wait should something else hold it.
	wctx, cancel := context.WithTimeout(ctx, s.mgr.Options().Grace+maxJobWait/2)
	defer cancel()
	st := j.Cancel(wctx)
	if !st.Done {
		return s.jobResult(req, st, "cancellation asked; the job is still stopping: follow it with job_status"), nil, nil
	}
	return s.jobResult(req, st, ""), nil, nil
}

// jobResult renders a poll: while the job runs, its new output; once it
// is done, its result as the run call would have rendered it, under a
// line naming the job.
func (s *Server) jobResult(req *mcp.CallToolRequest, st session.JobStatus, note string) *mcp.CallToolResult {
	head := fmt.Sprintf("[job: %s", st.ID)
	if st.Session != "" {
		head += ", session: " + st.Session
	}
	if !st.Done {
		head += fmt.Sprintf(", running for %s]", st.Elapsed.Round(time.Second))
		var b strings.Builder
		b.WriteString(head + "\n")
		if st.Dropped > 0 {
			fmt.Fprintf(&b, "[… %d bytes of output not shown; the final result has stdout and stderr, each capped]\n", st.Dropped)
		}
		if st.Output == "" {
			b.WriteString("(no new output)\n")
		} else {
			b.WriteString(st.Output)
			if !strings.HasSuffix(st.Output, "\n") {
				b.WriteString("\n")
			}
		}
		if note != "" {
			fmt.Fprintf(&b, "[kiln: %s]\n", note)
		}
		fmt.Fprintf(&b, "[kiln: still running; call job_status(job=%q, wait_s=%g) again for more]", st.ID, maxJobWait.Seconds())
		sc := map[string]any{"job": st.ID, "state": "running", "elapsed_s": st.Elapsed.Seconds(), "output": st.Output}
		if st.Session != "" {
			sc["session"] = st.Session
		}
		if st.Dropped > 0 {
			sc["output_dropped_bytes"] = st.Dropped
		}
		return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: b.String()}}, StructuredContent: sc}
	}
	head += fmt.Sprintf(", ended after %s]", st.Elapsed.Round(time.Millisecond))
	if note != "" {
		head += "\n[kiln: " + note + "]"
	}
	if st.Err != nil {
		res := s.failure(s.log.With("job", st.ID), st.Err)
		prefixText(res, head)
		res.StructuredContent = map[string]any{"job": st.ID, "state": "done", "error": res.Content[0].(*mcp.TextContent).Text}
		return res
	}
	// As a foreground call: what is too big to inline becomes the
	// caller's resources.
	res := s.renderWith(s.linksFor(req, st.Session), st.Outcome, st.Produced)
	prefixText(res, head)
	if sc, ok := res.StructuredContent.(map[string]any); ok {
		sc["job"], sc["state"] = st.ID, "done"
	}
	return res
}

// prefixText puts line at the head of the result's first text block.
func prefixText(res *mcp.CallToolResult, line string) {
	if len(res.Content) > 0 {
		if t, ok := res.Content[0].(*mcp.TextContent); ok {
			t.Text = line + "\n" + t.Text
			return
		}
	}
	res.Content = append([]mcp.Content{&mcp.TextContent{Text: line}}, res.Content...)
}
