package mcpserver_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// liveness bounds how long a test waits for what must happen.
const liveness = 30 * time.Second

// inProcessServer serves kiln on the in-process test backend (no root);
// each call to connect opens another client of the same server.
func inProcessServer(t *testing.T, opts session.Options) (connect func() *mcp.ClientSession, b *sessiontest.Backend) {
	t.Helper()
	b = sessiontest.New(t, nil)
	opts.Backend = b
	mgr := session.NewManager(opts)
	t.Cleanup(func() {
		done := make(chan struct{})
		go func() { mgr.Close(); close(done) }()
		select {
		case <-done:
		case <-time.After(liveness):
			t.Error("closing the manager hangs")
		}
		if n := b.Live(); n != 0 {
			t.Errorf("%d boxes outlive the server", n)
		}
	})
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: b.Name()})
	return func() *mcp.ClientSession { return dial(t, srv) }, b
}

// callAsync calls a tool without waiting; the result or protocol error
// arrives on the channel.
func callAsync(cs *mcp.ClientSession, tool string, args map[string]any) <-chan *mcp.CallToolResult {
	out := make(chan *mcp.CallToolResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*liveness)
		defer cancel()
		res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
		if err != nil {
			res = &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: "protocol error: " + err.Error()}}}
		}
		out <- res
	}()
	return out
}

func await(t *testing.T, what string, c <-chan *mcp.CallToolResult) *mcp.CallToolResult {
	t.Helper()
	select {
	case res := <-c:
		return res
	case <-time.After(liveness):
		t.Fatalf("%s hangs", what)
		return nil
	}
}

func until(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(liveness)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestBusyIsAToolResult: a call past the cap on live boxes gets a tool
// result with isError that says the server is at its box limit and to
// retry, not a protocol error and not a new box.
func TestBusyIsAToolResult(t *testing.T) {
	connect, b := inProcessServer(t, session.Options{Mode: session.ModePerCall, MaxBoxes: 1, BoxWait: 100 * time.Millisecond})
	cs := connect()
	gate := filepath.Join(t.TempDir(), "go")
	held := callAsync(cs, "run_shell", map[string]any{"command": fmt.Sprintf("until [ -e %s ]; do sleep 0.02; done; echo held", gate)})
	until(t, func() bool { return b.Live() == 1 }, "the first call to hold the only box")
	res := call(t, connect(), "run_shell", map[string]any{"command": "echo second"})
	if !res.IsError || !strings.Contains(text(res), "busy") || !strings.Contains(text(res), "--max-boxes") || !strings.Contains(text(res), "retry") {
		t.Errorf("a call past the box cap: isError=%v %q", res.IsError, text(res))
	}
	if p := b.Peak(); p > 1 {
		t.Errorf("%d live boxes; the cap is 1", p)
	}
	os.WriteFile(gate, nil, 0o644)
	if res := await(t, "the holding call", held); res.IsError || !strings.Contains(text(res), "held") {
		t.Errorf("the holding call: %q", text(res))
	}
	list, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tool := range list.Tools {
		if !strings.HasPrefix(tool.Name, "run_") {
			continue // the job tools run nothing
		}
		if !strings.Contains(tool.Description, "At most 1 sandboxes run at once") || !strings.Contains(tool.Description, "busy") {
			t.Errorf("%s does not state the box cap: %s", tool.Name, tool.Description)
		}
	}
}

// TestSessionQuotaIsAToolResult: past the principal's session quota a new
// session is refused with a result naming the limit and its flag.
func TestSessionQuotaIsAToolResult(t *testing.T) {
	connect, _ := inProcessServer(t, session.Options{MaxSessionsPerPrincipal: 2})
	cs := connect()
	for i := range 2 {
		if res := call(t, cs, "run_shell", map[string]any{"command": "true", "session": fmt.Sprint("s", i)}); res.IsError {
			t.Fatalf("session %d: %q", i, text(res))
		}
	}
	res := call(t, cs, "run_shell", map[string]any{"command": "true", "session": "third"})
	if !res.IsError || !strings.Contains(text(res), "2 live sessions") || !strings.Contains(text(res), "--max-sessions-per-principal") {
		t.Errorf("a third session past a quota of 2: isError=%v %q", res.IsError, text(res))
	}
}

// TestResetStuckSession: the box's agent stops answering while list_files
// holds the session; reset_session returns, the box is destroyed, and the
// stuck call ends with an error result.
func TestResetStuckSessionInProcess(t *testing.T) {
	connect, b := inProcessServer(t, session.Options{})
	one, two := connect(), connect()
	if res := call(t, one, "run_shell", map[string]any{"command": "touch f", "session": "s"}); res.IsError {
		t.Fatal(text(res))
	}
	b.Freeze()
	listed := callAsync(one, "list_files", map[string]any{"session": "s"})
	until(t, func() bool { return b.Stuck() > 0 }, "list_files to reach the stopped agent")
	reset := await(t, "reset_session", callAsync(two, "reset_session", map[string]any{"session": "s"}))
	if reset.IsError || !strings.Contains(text(reset), "destroyed") {
		t.Errorf("reset: %q", text(reset))
	}
	if res := await(t, "the stuck list_files", listed); !res.IsError || strings.Contains(text(res), "protocol error") {
		t.Errorf("the stuck call: isError=%v %q", res.IsError, text(res))
	}
	until(t, func() bool { return b.Live() == 0 }, "the stuck box to be destroyed")
	if res := call(t, two, "run_shell", map[string]any{"command": "ls", "session": "s"}); res.IsError || strings.Contains(text(res), "f\n") {
		t.Errorf("after reset: %q", text(res))
	}
}
