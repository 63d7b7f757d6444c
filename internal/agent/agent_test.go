package agent

import (
	"encoding/base64"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"

	"kiln/internal/agentproto"
)

// startAgent runs an agent on pipes, as a backend would, without a box.
func startAgent(t *testing.T, preload ...string) (call func(agentproto.Request) agentproto.Response, ws string) {
	t.Helper()
	py, err := exec.LookPath("/usr/bin/python3")
	if err != nil {
		t.Skip("needs /usr/bin/python3")
	}
	ws = t.TempDir()
	hr, aw := io.Pipe()
	ar, hw := io.Pipe()
	a := New(Config{Workspace: ws, Python: py, Preload: preload, UID: -1, GID: -1})
	done := make(chan error, 1)
	go func() { done <- a.Serve(ar, aw) }()
	t.Cleanup(func() { hw.Close(); <-done })
	var hello agentproto.Hello
	if err := agentproto.ReadFrame(hr, &hello); err != nil {
		t.Fatalf("reading hello: %v", err)
	}
	if hello.Python == "" {
		t.Fatalf("hello without python: %+v", hello)
	}
	var id uint64
	return func(req agentproto.Request) agentproto.Response {
		id++
		req.ID = id
		if err := agentproto.WriteFrame(hw, &req); err != nil {
			t.Fatal(err)
		}
		var resp agentproto.Response
		if err := agentproto.ReadFrame(hr, &resp); err != nil {
			t.Fatal(err)
		}
		if resp.ID != id {
			t.Fatalf("response id %d, want %d", resp.ID, id)
		}
		return resp
	}, ws
}

func TestPythonCells(t *testing.T) {
	call, _ := startAgent(t)
	py := func(code string) *agentproto.ExecResult {
		t.Helper()
		resp := call(agentproto.Request{Op: agentproto.OpPython, Code: code})
		if resp.Error != "" || resp.Exec == nil {
			t.Fatalf("%q: %+v", code, resp)
		}
		return resp.Exec
	}
	if r := py("x = 21\nprint('hi')\nx * 2"); r.Stdout.Text != "hi\n" || r.Result["text/plain"] != "42" {
		t.Errorf("last expression: stdout %q result %v", r.Stdout.Text, r.Result)
	}
	if r := py("x"); r.Result["text/plain"] != "21" {
		t.Errorf("state across cells: %v", r.Result)
	}
	r := py("def f():\n    return 1/0\nf()")
	if r.Error == nil || r.Error.Name != "ZeroDivisionError" || !strings.Contains(r.Error.Traceback, "<cell 3>") ||
		!strings.Contains(r.Error.Traceback, "return 1/0") || strings.Contains(r.Error.Traceback, "kiln-driver") {
		t.Errorf("traceback: %+v", r.Error)
	}
	if r := py("import sys; sys.stderr.write('warn\\n'); import os; os.system('echo from-child')"); r.Stderr.Text != "warn\n" || !strings.Contains(r.Stdout.Text, "from-child") {
		t.Errorf("stderr %q stdout %q", r.Stderr.Text, r.Stdout.Text)
	}
	if r := py("class C:\n    def _repr_html_(self): return '<b>c</b>'\n    def _repr_png_(self): return b'\\x89PNG'\ndisplay(C())\nC()"); len(r.Displays) != 1 || r.Displays[0]["text/html"] != "<b>c</b>" || r.Result["image/png"] != base64.StdEncoding.EncodeToString([]byte("\x89PNG")) {
		t.Errorf("display protocol: %+v %+v", r.Displays, r.Result)
	}
	if r := py("def ("); r.Error == nil || r.Error.Name != "SyntaxError" {
		t.Errorf("syntax error: %+v", r.Error)
	}
	if r := py("print('x' * 100000)"); r.Stdout.Total != 100001 || len(r.Stdout.Text) > defaultMaxOutput {
		t.Errorf("flood: total %d kept %d", r.Stdout.Total, len(r.Stdout.Text))
	}
	if r := py("import os; os._exit(3)"); r.Error == nil || r.Error.Name != "KernelDied" {
		t.Errorf("kernel exit: %+v", r.Error)
	}
	if r := py("x = 5\nx"); r.Result["text/plain"] != "5" {
		t.Errorf("after restart: %+v", r)
	}
}

func TestFiles(t *testing.T) {
	call, ws := startAgent(t)
	if r := call(agentproto.Request{Op: agentproto.OpWrite, Path: "a/b/c.txt", Data: []byte("hello")}); r.Error != "" {
		t.Fatal(r.Error)
	}
	if r := call(agentproto.Request{Op: agentproto.OpRead, Path: ws + "/a/b/c.txt"}); string(r.Data) != "hello" || r.Size != 5 {
		t.Errorf("read back: %+v", r)
	}
	for _, c := range []struct {
		off, max int64
		want     string
	}{{1, 3, "ell"}, {3, 0, "lo"}, {5, 0, ""}, {9, 2, ""}} {
		r := call(agentproto.Request{Op: agentproto.OpRead, Path: "a/b/c.txt", Offset: c.off, MaxBytes: c.max})
		if r.Error != "" || string(r.Data) != c.want || r.Size != 5 || r.Offset != c.off {
			t.Errorf("read from %d, at most %d: %+v, want %q", c.off, c.max, r, c.want)
		}
	}
	if r := call(agentproto.Request{Op: agentproto.OpRead, Path: "a/b/c.txt", Offset: -1}); r.Error == "" {
		t.Errorf("a negative offset was read: %+v", r)
	}
	os.Symlink("/etc/passwd", ws+"/evil")
	os.Symlink("/etc", ws+"/evildir")
	for _, p := range []string{"/etc/passwd", "../x", "evil", "evildir/passwd", "a/../../x", "x\x00y", strings.Repeat("a", 5000)} {
		if r := call(agentproto.Request{Op: agentproto.OpRead, Path: p}); r.Error == "" {
			t.Errorf("read %q: no error, got %q", p, r.Data)
		}
		if r := call(agentproto.Request{Op: agentproto.OpWrite, Path: p, Data: []byte("x")}); r.Error == "" {
			t.Errorf("write %q: no error", p)
		}
	}
	if r := call(agentproto.Request{Op: agentproto.OpList}); len(r.Files) < 3 {
		t.Errorf("list: %+v", r)
	}
}
