package mcpserver_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// jobOf is the job handle of a background start, from its structured
// content, checked against its text.
func jobOf(t *testing.T, res *mcp.CallToolResult) string {
	t.Helper()
	sc, _ := res.StructuredContent.(map[string]any)
	id, _ := sc["job"].(string)
	if res.IsError || id == "" || !strings.Contains(text(res), "[job: "+id) {
		t.Fatalf("not a job start: %q %v", text(res), res.StructuredContent)
	}
	return id
}

// pollJob calls job_status until the job is done and returns the final
// result and the output the polls returned while it ran.
func pollJob(t *testing.T, cs *mcp.ClientSession, id string) (*mcp.CallToolResult, string) {
	t.Helper()
	var live strings.Builder
	for deadline := time.Now().Add(2 * liveness); time.Now().Before(deadline); {
		res := call(t, cs, "job_status", map[string]any{"job": id, "wait_s": 0.5})
		sc, _ := res.StructuredContent.(map[string]any)
		if sc["state"] == "done" {
			return res, live.String()
		}
		if sc["state"] != "running" {
			t.Fatalf("job_status: %q %v", text(res), sc)
		}
		out, _ := sc["output"].(string)
		live.WriteString(out)
	}
	t.Fatalf("job %s did not end", id)
	return nil, ""
}

// TestJobTools: a background run returns at once with a handle; the
// session refuses other calls, naming the job; job_status returns the
// output as it comes, then the result as run_python renders it, a chart
// as an image block; cancel_job stops a job.
func TestJobTools(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := connect(t, b, session.ModeSession)
		start := time.Now()
		res := call(t, cs, "run_python", map[string]any{"session": "bg", "background": true, "code": `
import time
import matplotlib.pyplot as plt
for i in range(5):
    print("step", i, flush=True)
    time.sleep(1)
plt.plot([1, 3, 2])
plt.show()
"finished"`})
		id := jobOf(t, res)
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("the background start took %s", d)
		}
		if sc := res.StructuredContent.(map[string]any); sc["session"] != "bg" {
			t.Errorf("start names session %v", sc["session"])
		}

		busy := call(t, cs, "run_python", map[string]any{"session": "bg", "code": "1"})
		if got := text(busy); !busy.IsError || !strings.Contains(got, id) || !strings.Contains(got, "job_status") || !strings.Contains(got, "busy") {
			t.Errorf("a call in the busy session: %q", got)
		}
		if got := text(call(t, cs, "list_files", map[string]any{"session": "bg"})); !strings.Contains(got, id) {
			t.Errorf("a file call in the busy session: %q", got)
		}

		final, live := pollJob(t, cs, id)
		if !strings.Contains(live, "step 0") {
			t.Errorf("polls while running returned %q", live)
		}
		got := text(final)
		if final.IsError || !strings.HasPrefix(got, "[job: "+id+", session: bg, ended after") || !strings.Contains(got, "step 4") || !strings.Contains(got, "Out: 'finished'") {
			t.Errorf("final result: %q", got)
		}
		if imgs := images(final); len(imgs) != 1 || imgs[0].MIMEType != "image/png" {
			t.Errorf("final result has %d images, want the chart", len(imgs))
		}
		if again := call(t, cs, "job_status", map[string]any{"job": id}); text(again) != got {
			t.Errorf("polling the ended job again: %q", text(again))
		}

		// The session is free again, and cancel stops a job.
		res = call(t, cs, "run_shell", map[string]any{"session": "bg", "background": true, "command": "echo begun; sleep 600"})
		id = jobOf(t, res)
		time.Sleep(500 * time.Millisecond)
		cancelled := call(t, cs, "cancel_job", map[string]any{"job": id})
		if got := text(cancelled); !cancelled.IsError || !strings.Contains(got, "cancelled (cancel_job)") || !strings.Contains(got, "begun") {
			t.Errorf("cancel_job: %q", got)
		}
		if got := text(call(t, cs, "cancel_job", map[string]any{"job": id})); !strings.Contains(got, "already ended") {
			t.Errorf("cancelling again: %q", got)
		}
		if res := call(t, cs, "run_python", map[string]any{"session": "bg", "code": "2+2"}); res.IsError || !strings.Contains(text(res), "Out: 4") {
			t.Errorf("after cancel: %q", text(res))
		}
	})
}

// TestJobToolArgs: bad job handles and waits are refused with a clear
// error, not a crash.
func TestJobToolArgs(t *testing.T) {
	connectTo, _ := inProcessServer(t, session.Options{})
	cs := connectTo()
	for _, c := range []struct {
		tool string
		args map[string]any
		want string
	}{
		{"job_status", map[string]any{"job": ""}, "job is empty"},
		{"job_status", map[string]any{"job": "job-0123"}, "no job"},
		{"job_status", map[string]any{"job": strings.Repeat("\x1b[31m", 500)}, "no job"},
		{"job_status", map[string]any{"job": "job-1", "wait_s": -1}, "wait_s must be positive"},
		{"cancel_job", map[string]any{"job": "nope"}, "no job"},
		{"run_python", map[string]any{"code": " ", "background": true}, "code is empty"},
		{"run_shell", map[string]any{"command": "true", "background": true, "timeout_s": -3}, "timeout_s must be positive"},
		{"run_shell", map[string]any{"command": "true", "background": true, "session": "../x"}, "session names"},
	} {
		res := call(t, cs, c.tool, c.args)
		if got := text(res); !res.IsError || !strings.Contains(got, c.want) {
			t.Errorf("%s %v: %q, want an error with %q", c.tool, c.args, got, c.want)
		}
	}
	// The descriptions tell the model what a running job does to its
	// session.
	tools, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, tool := range tools.Tools {
		seen[tool.Name] = true
		if (tool.Name == "run_python" || tool.Name == "run_shell") && !strings.Contains(tool.Description, "refused at once with a \"busy\" error") {
			t.Errorf("%s does not say a job makes its session busy: %q", tool.Name, tool.Description)
		}
	}
	if !seen["job_status"] || !seen["cancel_job"] {
		t.Errorf("tools: %v", seen)
	}
}

// TestJobOwnedOverHTTP: over HTTP with two tokens, principal B can
// neither poll nor cancel A's job, nor learn that it exists; A can, from
// a new connection.
func TestJobOwnedOverHTTP(t *testing.T) {
	srv := serve(t, sessiontest.New(t, nil), session.Options{Mode: session.ModeSession, Grace: time.Second})
	alice, bob := strings.Repeat("a", 32), strings.Repeat("b", 32)
	ts := httptest.NewServer(srv.Handler(mcpserver.HTTPOptions{Tokens: []mcpserver.Token{{Principal: "alice", Secret: alice}, {Principal: "bob", Secret: bob}}}))
	defer ts.Close()
	client := func(token string) *mcp.ClientSession {
		cs, err := mcp.NewClient(&mcp.Implementation{Name: "t", Version: "1"}, nil).Connect(context.Background(),
			&mcp.StreamableClientTransport{Endpoint: ts.URL + "/mcp", HTTPClient: &http.Client{Transport: bearer{token}}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cs.Close() })
		return cs
	}
	a := client(alice)
	id := jobOf(t, call(t, a, "run_shell", map[string]any{"session": "work", "background": true, "command": "echo alice-secret; sleep 600"}))

	b := client(bob)
	for _, tool := range []string{"job_status", "cancel_job"} {
		res := call(t, b, tool, map[string]any{"job": id})
		if got := text(res); !res.IsError || !strings.Contains(got, "no job") || strings.Contains(got, "alice-secret") {
			t.Errorf("bob's %s of alice's job: %q", tool, got)
		}
	}
	// Bob's same-named session is his own, not busy with alice's job.
	if res := call(t, b, "run_shell", map[string]any{"session": "work", "command": "echo bob"}); res.IsError || !strings.Contains(text(res), "bob") {
		t.Errorf("bob's session: %q", text(res))
	}

	a.Close()
	a2 := client(alice)
	deadline := time.Now().Add(liveness)
	for {
		res := call(t, a2, "job_status", map[string]any{"job": id, "wait_s": 1})
		if strings.Contains(text(res), "alice-secret") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("alice's new connection: %q", text(res))
		}
	}
	if res := call(t, a2, "cancel_job", map[string]any{"job": id}); !strings.Contains(text(res), "cancelled") {
		t.Errorf("alice's cancel: %q", text(res))
	}
}

// TestJobPerCallTool: in per-call mode a background job stages its
// files, runs in a fresh box, and its result returns the files it wrote.
func TestJobPerCallTool(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := connect(t, b, session.ModePerCall)
		if res := call(t, cs, "run_shell", map[string]any{"background": true, "session": "s", "command": "true"}); !res.IsError || !strings.Contains(text(res), "per-call mode") {
			t.Errorf("a session in per-call mode: %q", text(res))
		}
		res := call(t, cs, "run_shell", map[string]any{"background": true, "command": "sleep 1; tr a-z A-Z < in.txt > out.txt", "files": map[string]any{"in.txt": "hello"}})
		id := jobOf(t, res)
		if _, ok := res.StructuredContent.(map[string]any)["session"]; ok {
			t.Errorf("a per-call job names a session: %v", res.StructuredContent)
		}
		final, _ := pollJob(t, cs, id)
		if got := text(final); final.IsError || !strings.Contains(got, "file out.txt (5 bytes):\nHELLO") {
			t.Errorf("per-call job result: %q", got)
		}
	})
}

// TestJobStatusProgress: a job_status call that waits and carries a
// progress token is sent progress naming the job and its newest output;
// one without a token is sent none.
func TestJobStatusProgress(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	cs, n := dialNotes(t, serve(t, b, session.Options{}))
	id := jobOf(t, call(t, cs, "run_python", map[string]any{"background": true, "code": "import time\nprint('early', flush=True)\ntime.sleep(30)"}))
	res := callToken(t, cs, "job_status", map[string]any{"job": id, "wait_s": 6}, "tok")
	if sc := res.StructuredContent.(map[string]any); sc["state"] != "running" || !strings.Contains(sc["output"].(string), "early") {
		t.Fatalf("job_status: %q", text(res))
	}
	progress, _ := n.take()
	if len(progress) == 0 || !strings.Contains(progress[0].Message, id) || !strings.Contains(progress[0].Message, "early") {
		t.Errorf("progress while job_status waited: %d notes, first %+v", len(progress), progress)
	}
	call(t, cs, "job_status", map[string]any{"job": id, "wait_s": 6})
	if progress, _ := n.take(); len(progress) != 0 {
		t.Errorf("%d progress notes without a token", len(progress))
	}
	call(t, cs, "cancel_job", map[string]any{"job": id})
}
