//lint:file-ignore SA1019 issue 15 asks for output as log messages where the client enabled logging; the SDK keeps logging working through its deprecation window (2026-07-28 revision).

package mcpserver_test

import (
	"bytes"
	"context"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/mcpserver"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// notes collects what a client is sent besides results.
type notes struct {
	mu       sync.Mutex
	progress []*mcp.ProgressNotificationParams
	logs     []*mcp.LoggingMessageParams
}

func (n *notes) take() ([]*mcp.ProgressNotificationParams, []*mcp.LoggingMessageParams) {
	n.mu.Lock()
	defer n.mu.Unlock()
	p, l := n.progress, n.logs
	n.progress, n.logs = nil, nil
	return p, l
}

// dialNotes connects a client that records progress and log messages.
func dialNotes(t *testing.T, srv *mcpserver.Server) (*mcp.ClientSession, *notes) {
	t.Helper()
	n := &notes{}
	ct, st := mcp.NewInMemoryTransports()
	ss, err := srv.MCP().Connect(context.Background(), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "1"}, &mcp.ClientOptions{
		ProgressNotificationHandler: func(_ context.Context, r *mcp.ProgressNotificationClientRequest) {
			n.mu.Lock()
			n.progress = append(n.progress, r.Params)
			n.mu.Unlock()
		},
		LoggingMessageHandler: func(_ context.Context, r *mcp.LoggingMessageRequest) {
			n.mu.Lock()
			n.logs = append(n.logs, r.Params)
			n.mu.Unlock()
		},
	}).Connect(context.Background(), ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs, n
}

// callToken calls a tool, with a progress token unless token is nil.
func callToken(t *testing.T, cs *mcp.ClientSession, tool string, args map[string]any, token any) *mcp.CallToolResult {
	return callLogging(t, cs, tool, args, token, "")
}

// callLogging is callToken asking for log messages of level and above
// ("" for none): in the request's _meta under the newest protocol, as set
// by logging/setLevel under older ones.
func callLogging(t *testing.T, cs *mcp.ClientSession, tool string, args map[string]any, token any, level mcp.LoggingLevel) *mcp.CallToolResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p := &mcp.CallToolParams{Name: tool, Arguments: args}
	if level != "" {
		p.Meta = mcp.Meta{mcp.MetaKeyLogLevel: level}
	}
	if token != nil {
		p.SetProgressToken(token)
	}
	res, err := cs.CallTool(ctx, p)
	if err != nil {
		t.Fatalf("%s: %v", tool, err)
	}
	return res
}

// TestLiveProgress: a 4 s call printing every second sends its lines in
// progress notifications (and log messages, once the client enables
// logging) to a client that sent a token, and nothing to one that did
// not; the result is the same either way.
func TestLiveProgress(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	cs, n := dialNotes(t, serve(t, b, session.Options{DefaultTimeout: 30 * time.Second, MaxOutput: 2000}))
	calls := []struct{ tool, arg, code string }{
		{"run_python", "code", "import time\nfor i in range(4):\n    print(f'tick {i}', flush=True)\n    time.sleep(1)"},
		{"run_shell", "command", "for i in 0 1 2 3; do echo tick $i; sleep 1; done"},
	}
	for _, c := range calls {
		t.Run(c.tool, func(t *testing.T) {
			res := callToken(t, cs, c.tool, map[string]any{c.arg: c.code}, nil)
			_, silent, _ := strings.Cut(text(res), "\n") // without the header, which says the box is new
			if res.IsError || !strings.Contains(silent, "tick 3") {
				t.Fatalf("without a token: %q", silent)
			}
			// The previous subtest's notifications may reach the client
			// after its result did (the client handles them on their own
			// goroutines); only this tool's count here.
			p, l := n.take()
			p = slices.DeleteFunc(p, func(p *mcp.ProgressNotificationParams) bool {
				tok, _ := p.ProgressToken.(string)
				return strings.HasPrefix(tok, "tok-") && tok != "tok-"+c.tool
			})
			l = slices.DeleteFunc(l, func(l *mcp.LoggingMessageParams) bool { return l.Logger != "kiln."+c.tool })
			if len(p)+len(l) != 0 {
				t.Fatalf("without a token: %d progress notifications, %d log messages", len(p), len(l))
			}

			if err := cs.SetLoggingLevel(context.Background(), &mcp.SetLoggingLevelParams{Level: "info"}); err != nil {
				t.Fatal(err)
			}
			res = callLogging(t, cs, c.tool, map[string]any{c.arg: c.code}, "tok-"+c.tool, "info")
			if _, body, _ := strings.Cut(text(res), "\n"); res.IsError || body != silent {
				t.Errorf("the result changed with a token:\n%q\nwant\n%q", text(res), silent)
			}
			progress, logs := n.take()
			var ticks []string
			last := -1.0
			for _, p := range progress {
				t.Logf("progress %.2f: %q", p.Progress, p.Message)
				if p.ProgressToken != "tok-"+c.tool {
					t.Errorf("token %v", p.ProgressToken)
				}
				if p.Progress <= last {
					t.Errorf("progress %v after %v", p.Progress, last)
				}
				last = p.Progress
				if strings.Contains(p.Message, "tick") {
					ticks = append(ticks, p.Message)
				}
				if len(p.Message) > 2*agentproto.MaxLiveTail {
					t.Errorf("a message of %d bytes", len(p.Message))
				}
			}
			if len(ticks) < 2 {
				t.Fatalf("%d progress notifications with output over a 4 s call, want at least 2", len(ticks))
			}
			var logged strings.Builder
			for _, l := range logs {
				s, _ := l.Data.(string)
				logged.WriteString(s)
			}
			if !strings.Contains(logged.String(), "tick 0\n") || !strings.Contains(logged.String(), "tick 2\n") {
				t.Errorf("log messages: %q", logged.String())
			}
			if err := cs.SetLoggingLevel(context.Background(), &mcp.SetLoggingLevelParams{Level: "error"}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestLiveProgressKeepalive: a call that prints nothing still reports
// every few seconds that it runs.
func TestLiveProgressKeepalive(t *testing.T) {
	cs, n := dialNotes(t, serve(t, sessiontest.New(t, nil), session.Options{DefaultTimeout: 30 * time.Second}))
	if res := callToken(t, cs, "run_shell", map[string]any{"command": "sleep 5.5"}, 7); res.IsError {
		t.Fatalf("%q", text(res))
	}
	progress, _ := n.take()
	if len(progress) != 1 || progress[0].Message != "running for 5s" {
		for _, p := range progress {
			t.Logf("%v: %q", p.Progress, p.Message)
		}
		t.Fatalf("%d progress notifications over a silent 5.5 s call, want one keepalive", len(progress))
	}
}

func init() {
	out := func(id uint64, tail string, total int64) []byte {
		return frame(&agentproto.Response{ID: id, Output: &agentproto.Output{Tail: tail, Total: total}})
	}
	hostileCases["output-unknown-id"] = hostileCase{answer: func(req agentproto.Request, _ uint64) []byte {
		return out(req.ID+1000, "x", 1)
	}}
	hostileCases["output-oversized"] = hostileCase{answer: func(req agentproto.Request, _ uint64) []byte {
		return out(req.ID, strings.Repeat("x", 1<<20), 1<<20)
	}}
	hostileCases["output-not-asked"] = hostileCase{answer: func(req agentproto.Request, _ uint64) []byte {
		return out(req.ID, "x", 1)
	}}
	hostileCases["output-with-answer"] = hostileCase{answer: func(req agentproto.Request, _ uint64) []byte {
		return frame(&agentproto.Response{ID: req.ID, Output: &agentproto.Output{}, Error: "x"})
	}}
	// A flood of well-formed reports, then an honest answer.
	hostileCases["output-flood"] = hostileCase{answer: func(req agentproto.Request, _ uint64) []byte {
		var buf bytes.Buffer
		tail := strings.Repeat("y\n", agentproto.MaxLiveTail/2)
		for i := range 20000 {
			buf.Write(out(req.ID, tail, int64(i+1)*int64(len(tail))))
		}
		buf.Write(honest(req))
		return buf.Bytes()
	}}
}

// TestHostileOutput: forged output frames end the call with an error
// result and a destroyed box, never reach the client, and a flood of
// well-formed ones costs the server neither memory nor a notification
// each.
func TestHostileOutput(t *testing.T) {
	b := &hostileBackend{timeout: time.Second}
	mgr := session.NewManager(session.Options{Backend: b, DefaultTimeout: 10 * time.Second, Grace: 200 * time.Millisecond})
	t.Cleanup(mgr.Close)
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: "hostile"})
	cs, n := dialNotes(t, srv)
	for _, c := range []struct {
		name  string
		token bool
		want  string
	}{
		{"output-unknown-id", true, "not pending"},
		{"output-oversized", true, "tail of"},
		{"output-not-asked", false, "asked for none"},
		{"output-with-answer", true, "carries an answer"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var token any
			if c.token {
				token = "tok"
			}
			args := map[string]any{"command": "hostile/" + c.name, "session": c.name}
			res := callToken(t, cs, "run_shell", args, token)
			if !res.IsError || !strings.Contains(text(res), c.want) {
				t.Errorf("want an error result mentioning %q, got isError=%v %.300q", c.want, res.IsError, text(res))
			}
			select {
			case <-b.lastHostile(t).destroyed:
			case <-time.After(5 * time.Second):
				t.Errorf("the box that sent it was not destroyed")
			}
			progress, _ := n.take()
			if len(progress) > 1 {
				t.Errorf("%d progress notifications for a forged frame", len(progress))
			}
			for _, p := range progress {
				if strings.Contains(p.Message, "x") {
					t.Errorf("forged output reached the client: %q", p.Message)
				}
			}
		})
	}
	t.Run("output-flood", func(t *testing.T) {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		start := time.Now()
		res := callToken(t, cs, "run_shell", map[string]any{"command": "hostile/output-flood", "session": "flood"}, "tok")
		runtime.GC()
		runtime.ReadMemStats(&after)
		if res.IsError || !strings.Contains(text(res), "ran: hostile/output-flood") {
			t.Fatalf("isError=%v %.300q", res.IsError, text(res))
		}
		took := time.Since(start)
		p, _ := n.take()
		grew := int64(after.HeapInuse) - int64(before.HeapInuse)
		t.Logf("20000 output frames in %s: %d progress notifications, heap in use grew by %d KiB", took.Round(time.Millisecond), len(p), grew>>10)
		// One a second at most (the first after a second), whatever the rate of frames.
		if limit := int(took / time.Second); len(p) > limit {
			t.Errorf("%d progress notifications in %s: not rate-limited", len(p), took)
		}
		if grew > 8<<20 {
			t.Errorf("heap in use grew by %d bytes over 20000 output frames", grew)
		}
	})
}

// TestLiveProgressPerCall: per-call mode reports the same way.
func TestLiveProgressPerCall(t *testing.T) {
	cs, n := dialNotes(t, serve(t, sessiontest.New(t, nil), session.Options{Mode: session.ModePerCall, DefaultTimeout: 30 * time.Second}))
	res := callToken(t, cs, "run_shell", map[string]any{"command": "for i in 0 1 2; do echo tick $i; sleep 1; done"}, "pc")
	if res.IsError || !strings.Contains(text(res), "tick 2") {
		t.Fatalf("%q", text(res))
	}
	progress, _ := n.take()
	if len(progress) < 2 || !strings.Contains(progress[len(progress)-1].Message, "tick 1") {
		t.Fatalf("%d progress notifications over a 3 s per-call run: %v", len(progress), progress)
	}
}
