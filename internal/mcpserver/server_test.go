package mcpserver_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/sandbox"
	"kiln/internal/session"
)

func call(t *testing.T, cs *mcp.ClientSession, tool string, args map[string]any) *mcp.CallToolResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	if err != nil {
		t.Fatalf("%s: %v", tool, err)
	}
	return res
}

func text(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

func images(res *mcp.CallToolResult) []*mcp.ImageContent {
	var out []*mcp.ImageContent
	for _, c := range res.Content {
		if ic, ok := c.(*mcp.ImageContent); ok {
			out = append(out, ic)
		}
	}
	return out
}

func TestToolsAndDescriptions(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := connect(t, b, session.ModeSession)
		list, err := cs.ListTools(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, tool := range list.Tools {
			names = append(names, tool.Name)
			if tool.OutputSchema != nil {
				t.Errorf("%s advertises an outputSchema; clients that honour it drop image blocks", tool.Name)
			}
		}
		slices.Sort(names)
		want := []string{"cancel_job", "delete_snapshot", "fork_session", "job_status", "list_files", "list_sessions", "list_snapshots", "read_file", "reset_session", "restore_session", "run_python", "run_shell", "snapshot_session", "write_file"}
		if !slices.Equal(names, want) {
			t.Errorf("tools %v, want %v", names, want)
		}
		for _, tool := range list.Tools {
			if tool.Name == "run_python" && (!strings.Contains(tool.Description, "NO network") || !strings.Contains(tool.Description, "20s")) {
				t.Errorf("run_python description does not state the live configuration: %s", tool.Description)
			}
		}
	})
}

func TestSessionCalls(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := connect(t, b, session.ModeSession)
		res := call(t, cs, "run_python", map[string]any{"code": "x = 40\nprint('hi')\nx + 2"})
		if res.IsError || !strings.Contains(text(res), "[session: default") || !strings.Contains(text(res), "hi\nOut: 42") {
			t.Fatalf("first call: %q", text(res))
		}
		if res := call(t, cs, "run_python", map[string]any{"code": "x"}); !strings.Contains(text(res), "Out: 40") {
			t.Errorf("state lost: %q", text(res))
		}
		res = call(t, cs, "run_python", map[string]any{"code": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"})
		if imgs := images(res); len(imgs) != 1 || imgs[0].MIMEType != "image/png" || string(imgs[0].Data[:4]) != "\x89PNG" {
			t.Errorf("want one PNG block, got %d: %q", len(imgs), text(res))
		}
		res = call(t, cs, "run_python", map[string]any{"code": "def f():\n    raise ValueError('boom')\nf()"})
		if !res.IsError || !strings.Contains(text(res), "ValueError: boom") || !strings.Contains(text(res), "raise ValueError") {
			t.Errorf("exception: %v %q", res.IsError, text(res))
		}
		res = call(t, cs, "run_python", map[string]any{"code": "print('y' * 10000)"})
		if !strings.Contains(text(res), "truncated 8001 of 10001 bytes") {
			t.Errorf("flood not truncated with a note: %.300q", text(res))
		}
		res = call(t, cs, "write_file", map[string]any{"path": "d/in.txt", "content": "from the model"})
		if res.IsError {
			t.Fatal(text(res))
		}
		if res := call(t, cs, "run_shell", map[string]any{"command": "cat d/in.txt"}); !strings.Contains(text(res), "from the model") {
			t.Errorf("shell did not see the file: %q", text(res))
		}
		call(t, cs, "run_python", map[string]any{"code": "plt.plot([1]); plt.savefig('p.png')"})
		if res := call(t, cs, "read_file", map[string]any{"path": "p.png"}); len(images(res)) != 1 {
			t.Errorf("read_file of a PNG: %q", text(res))
		}
		if res := call(t, cs, "read_file", map[string]any{"path": "../../etc/passwd"}); !res.IsError {
			t.Errorf("read outside the workspace: %q", text(res))
		}
		if res := call(t, cs, "run_python", map[string]any{"code": "1", "session": "bad name!"}); !res.IsError {
			t.Errorf("bad session name accepted")
		}
		if res := call(t, cs, "run_python", map[string]any{"code": "x", "session": "other"}); !res.IsError || !strings.Contains(text(res), "NameError") {
			t.Errorf("named session shares state with default: %q", text(res))
		}
	})
}

func TestTimeoutRestarts(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := connect(t, b, session.ModeSession)
		call(t, cs, "run_python", map[string]any{"code": "kept = 1"})
		res := call(t, cs, "run_python", map[string]any{"code": "while True: pass", "timeout_s": 1})
		if !res.IsError || !strings.Contains(text(res), "KeyboardInterrupt") || !strings.Contains(text(res), "the call ran past its time limit of 1 s") {
			t.Errorf("interruptible loop: %q", text(res))
		}
		if res := call(t, cs, "run_python", map[string]any{"code": "kept"}); !strings.Contains(text(res), "Out: 1") {
			t.Errorf("state lost after an interrupt: %q", text(res))
		}
		res = call(t, cs, "run_python", map[string]any{"code": "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass", "timeout_s": 1})
		if !res.IsError || !strings.Contains(text(res), "restarted") {
			t.Errorf("uninterruptible loop: %q", text(res))
		}
		if res := call(t, cs, "run_python", map[string]any{"code": "'kept' in dir()"}); !strings.Contains(text(res), "Out: False") || !strings.Contains(text(res), "new sandbox") {
			t.Errorf("after restart: %q", text(res))
		}
	})
}

func TestPerCallMode(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := connect(t, b, session.ModePerCall)
		list, err := cs.ListTools(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Tools) != 4 {
			t.Errorf("per-call mode offers %d tools, want run_python, run_shell, job_status and cancel_job", len(list.Tools))
		}
		res := call(t, cs, "run_python", map[string]any{
			"code":  "import os\nsecret = 1\nopen('out.txt', 'w').write(open('in.txt').read().upper())",
			"files": map[string]any{"in.txt": "hello"},
		})
		if res.IsError || !strings.Contains(text(res), "file out.txt (5 bytes):\nHELLO") {
			t.Errorf("per-call files: %q", text(res))
		}
		if res := call(t, cs, "run_python", map[string]any{"code": "import os\nprint(os.listdir('.'), 'secret' in dir())"}); !strings.Contains(text(res), "[] False") {
			t.Errorf("state leaked between per-call runs: %q", text(res))
		}
	})
}
