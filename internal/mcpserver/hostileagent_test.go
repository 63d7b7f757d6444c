package mcpserver_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/mcpserver"
	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// A hostile agent: a test-only backend whose boxes speak kiln-agent's
// protocol over an in-process pipe. It answers honestly, except for a
// request whose code or path names a case of hostileCases: then it writes
// that case's bytes, as model code that took over the agent's stream would.
// Everything from there on is the real AgentConn, session.Manager and
// mcpserver.Server.

// hostileCase is what a taken-over agent writes in answer to one request.
type hostileCase struct {
	// answer returns the raw bytes to write for req; nil writes nothing.
	answer func(req agentproto.Request, last uint64) []byte
	// hangUp closes the stream after the answer; stopReading stops
	// reading requests too (a SIGSTOPped agent).
	hangUp, stopReading bool
}

// frame encodes v as one frame, the way an agent would.
func frame(v any) []byte {
	var buf bytes.Buffer
	if err := agentproto.WriteFrame(&buf, v); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// rawFrame wraps body in a frame header without looking at it.
func rawFrame(body string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	return append(b, body...)
}

func execFrame(id uint64, res agentproto.ExecResult) []byte {
	return frame(&agentproto.Response{ID: id, Exec: &res})
}

var hostileCases = map[string]hostileCase{
	"negative-cut": {answer: func(req agentproto.Request, _ uint64) []byte {
		return execFrame(req.ID, agentproto.ExecResult{Stdout: agentproto.Stream{Text: "hello", Total: 10, Cut: -1}})
	}},
	"cut-past-text": {answer: func(req agentproto.Request, _ uint64) []byte {
		return execFrame(req.ID, agentproto.ExecResult{Stdout: agentproto.Stream{Text: "hello", Total: 10, Cut: 99}})
	}},
	"negative-total": {answer: func(req agentproto.Request, _ uint64) []byte {
		return execFrame(req.ID, agentproto.ExecResult{Stderr: agentproto.Stream{Text: "x", Total: -5}})
	}},
	"stdout-over-cap": {answer: func(req agentproto.Request, _ uint64) []byte {
		big := strings.Repeat("y", 1<<20)
		return execFrame(req.ID, agentproto.ExecResult{Stdout: agentproto.Stream{Text: big, Total: int64(len(big))}})
	}},
	"unknown-id": {answer: func(req agentproto.Request, _ uint64) []byte {
		return execFrame(req.ID+1000, agentproto.ExecResult{Stdout: agentproto.Stream{Text: "forged", Total: 6}})
	}},
	"stale-id": {answer: func(req agentproto.Request, last uint64) []byte {
		// The id of the request answered before this one.
		return execFrame(last, agentproto.ExecResult{Stdout: agentproto.Stream{Text: "forged", Total: 6}})
	}},
	"duplicate": {answer: func(req agentproto.Request, _ uint64) []byte {
		f := execFrame(req.ID, agentproto.ExecResult{Stdout: agentproto.Stream{Text: "once", Total: 4}})
		return append(f, f...)
	}},
	"no-result": {answer: func(req agentproto.Request, _ uint64) []byte {
		return frame(&agentproto.Response{ID: req.ID})
	}},
	"too-many-displays": {answer: func(req agentproto.Request, _ uint64) []byte {
		d := make([]agentproto.MimeBundle, 100)
		for i := range d {
			d[i] = agentproto.MimeBundle{"text/plain": "x"}
		}
		return execFrame(req.ID, agentproto.ExecResult{Displays: d})
	}},
	"empty-objects": {answer: func(req agentproto.Request, _ uint64) []byte {
		// Three bytes per entry; decoded naively, each costs a map.
		return rawFrame(`{"id":` + jsonInt(req.ID) + `,"exec":{"stdout":{"text":"","total":0},"stderr":{"text":"","total":0},"displays":[` + strings.Repeat("{},", 2_000_000) + `{}]}}`)
	}},
	"huge-error": {answer: func(req agentproto.Request, _ uint64) []byte {
		// Over MaxMessage, within the longest answer to the request.
		return frame(&agentproto.Response{ID: req.ID, Error: strings.Repeat("e", req.MaxAnswer()/2)})
	}},
	"huge-traceback": {answer: func(req agentproto.Request, _ uint64) []byte {
		return execFrame(req.ID, agentproto.ExecResult{Error: &agentproto.ExecError{Name: "ValueError", Value: strings.Repeat("v", 1<<20), Traceback: strings.Repeat("t", 1<<20)}})
	}},
	"rich-flood": {answer: func(req agentproto.Request, _ uint64) []byte {
		// 5 MiB: over MaxRich, within the longest answer to an exec.
		d := make([]agentproto.MimeBundle, 5)
		for i := range d {
			d[i] = agentproto.MimeBundle{"text/html": strings.Repeat("<b>x</b>", 1<<17), "text/plain": "<b>"}
		}
		return execFrame(req.ID, agentproto.ExecResult{Displays: d})
	}},
	"bad-base64": {answer: func(req agentproto.Request, _ uint64) []byte {
		return execFrame(req.ID, agentproto.ExecResult{Displays: []agentproto.MimeBundle{{"image/png": "!!not base64!!", "text/plain": "<Figure>"}}})
	}},
	"unknown-mime": {answer: func(req agentproto.Request, _ uint64) []byte {
		return execFrame(req.ID, agentproto.ExecResult{Displays: []agentproto.MimeBundle{{"application/x-evil": strings.Repeat("x", 1<<20), "text/plain": "plain"}}})
	}},
	"over-answer-bound": {answer: func(req agentproto.Request, _ uint64) []byte {
		d := make([]agentproto.MimeBundle, 20)
		for i := range d {
			d[i] = agentproto.MimeBundle{"text/html": strings.Repeat("<b>x</b>", 1<<17)}
		}
		return execFrame(req.ID, agentproto.ExecResult{Displays: d})
	}},
	"oversize-frame": {answer: func(req agentproto.Request, _ uint64) []byte {
		return binary.BigEndian.AppendUint32(nil, agentproto.MaxFrame+1)
	}},
	"invalid-json": {answer: func(req agentproto.Request, _ uint64) []byte {
		return rawFrame(`{"id":` + jsonInt(req.ID) + `,"exec":{"stdout":`)
	}},
	"wrong-types": {answer: func(req agentproto.Request, _ uint64) []byte {
		return rawFrame(`{"id":` + jsonInt(req.ID) + `,"exec":{"stdout":{"text":5,"cut":"x"}}}`)
	}},
	"frame-then-eof": {hangUp: true, answer: func(req agentproto.Request, _ uint64) []byte {
		f := execFrame(req.ID, agentproto.ExecResult{Stdout: agentproto.Stream{Text: "half", Total: 4}})
		return f[:len(f)/2]
	}},
	"stalled": {answer: func(agentproto.Request, uint64) []byte { return nil }},
	"stopped": {stopReading: true, answer: func(agentproto.Request, uint64) []byte { return nil }},
	"read-over-max": {answer: func(req agentproto.Request, _ uint64) []byte {
		data := make([]byte, req.MaxBytes+1)
		return frame(&agentproto.Response{ID: req.ID, Data: data, Size: int64(len(data))})
	}},
	"read-size-below-data": {answer: func(req agentproto.Request, _ uint64) []byte {
		return frame(&agentproto.Response{ID: req.ID, Data: []byte("abcdef"), Size: 2})
	}},
	"list-negative-size": {answer: func(req agentproto.Request, _ uint64) []byte {
		return frame(&agentproto.Response{ID: req.ID, Files: []agentproto.FileInfo{{Path: "a", Size: -1}}})
	}},
	"list-escaping-path": {answer: func(req agentproto.Request, _ uint64) []byte {
		return frame(&agentproto.Response{ID: req.ID, Files: []agentproto.FileInfo{{Path: "../../etc/shadow", Size: 1}}})
	}},
	"list-too-many": {answer: func(req agentproto.Request, _ uint64) []byte {
		files := make([]agentproto.FileInfo, 200_000)
		for i := range files {
			files[i] = agentproto.FileInfo{Path: "f"}
		}
		return frame(&agentproto.Response{ID: req.ID, Files: files})
	}},
}

func jsonInt(n uint64) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// hostileBackend makes boxes that run hostileAgent.
type hostileBackend struct {
	mu      sync.Mutex
	hello   []byte // the next box's hello, raw; nil for an honest one
	boxes   []*hostileBox
	timeout time.Duration // AgentConn's request deadline
}

type hostileBox struct {
	id        string
	hostile   chan struct{} // closed once it sent a hostile answer
	destroyed chan struct{}
	once, h   sync.Once
}

func (b *hostileBackend) Name() string { return "hostile" }

func (b *hostileBackend) Close() error { return nil }

func (b *hostileBackend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	host, guest := net.Pipe()
	box := &hostileBox{id: spec.ID, hostile: make(chan struct{}), destroyed: make(chan struct{})}
	b.mu.Lock()
	hello := b.hello
	b.hello = nil
	b.boxes = append(b.boxes, box)
	b.mu.Unlock()
	if hello == nil {
		hello = frame(&agentproto.Hello{Version: 1, Python: "3.11.2"})
	} else {
		box.h.Do(func() { close(box.hostile) })
	}
	go box.serve(guest, hello)
	return newAgentConn(ctx, spec.ID, host, func() error {
		box.once.Do(func() { close(box.destroyed) })
		guest.Close()
		return nil
	}, b.timeout)
}

// lastHostile is the box that last misbehaved.
func (b *hostileBackend) lastHostile(t *testing.T) *hostileBox {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	for i := len(b.boxes) - 1; i >= 0; i-- {
		select {
		case <-b.boxes[i].hostile:
			return b.boxes[i]
		default:
		}
	}
	t.Fatal("no box misbehaved")
	return nil
}

func (box *hostileBox) serve(conn net.Conn, hello []byte) {
	defer conn.Close()
	if _, err := conn.Write(hello); err != nil || len(hello) < 4 {
		return // a partial hello, then the stream ends
	}
	var last uint64
	for {
		var req agentproto.Request
		if err := agentproto.ReadFrame(conn, &req); err != nil {
			return
		}
		key := req.Code
		if req.Op != agentproto.OpPython && req.Op != agentproto.OpShell {
			key = req.Path
		}
		c, ok := hostileCases[strings.TrimPrefix(key, "hostile/")]
		if !ok || !strings.HasPrefix(key, "hostile/") {
			if _, err := conn.Write(honest(req)); err != nil {
				return
			}
			last = req.ID
			continue
		}
		box.h.Do(func() { close(box.hostile) })
		if b := c.answer(req, last); len(b) > 0 {
			if _, err := conn.Write(b); err != nil {
				return
			}
		}
		if c.hangUp {
			return
		}
		if c.stopReading {
			<-box.destroyed
			return
		}
		last = req.ID
	}
}

// honest is what a well-behaved agent answers.
func honest(req agentproto.Request) []byte {
	resp := &agentproto.Response{ID: req.ID}
	switch req.Op {
	case agentproto.OpPython, agentproto.OpShell:
		out := "ran: " + req.Code + "\n"
		resp.Exec = &agentproto.ExecResult{Stdout: agentproto.Stream{Text: out, Total: int64(len(out)), Cut: len(out)}}
	case agentproto.OpRead:
		resp.Data, resp.Size = []byte("content"), 7
	case agentproto.OpList, agentproto.OpChanges:
		resp.Files = []agentproto.FileInfo{{Path: "a.txt", Size: 3}}
	}
	return frame(resp)
}

// hostileServer serves kiln on the hostile backend and returns two clients:
// one for the attacker, one for a bystander.
func hostileServer(t *testing.T, mode session.Mode) (*hostileBackend, *mcp.ClientSession, *mcp.ClientSession) {
	t.Helper()
	b := &hostileBackend{timeout: time.Second}
	mgr := session.NewManager(session.Options{Backend: b, Mode: mode, DefaultTimeout: 5 * time.Second, Grace: 200 * time.Millisecond})
	t.Cleanup(mgr.Close)
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: "hostile"})
	return b, dial(t, srv), dial(t, srv)
}

// callWithin calls a tool and fails the test if no answer comes in time:
// a hung call is a finding, not a slow test.
func callWithin(t *testing.T, cs *mcp.ClientSession, tool string, args map[string]any) *mcp.CallToolResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	if err != nil {
		t.Fatalf("%s: %v", tool, err)
	}
	return res
}

// TestHostileAgent sends malformed frames from a box through the real
// session and MCP layers. Each must end as an error result for that call
// and a destroyed box; the server keeps answering its other sessions.
func TestHostileAgent(t *testing.T) {
	cases := []struct {
		name, tool string
		args       map[string]any
		want       string // in the error result
	}{
		{"negative-cut", "run_python", nil, "cut"},
		{"cut-past-text", "run_python", nil, "cut"},
		{"negative-total", "run_shell", nil, "total"},
		{"stdout-over-cap", "run_python", nil, "stdout"},
		{"unknown-id", "run_python", nil, "not pending"},
		{"stale-id", "run_python", nil, "not pending"},
		{"duplicate", "run_python", nil, ""},
		{"no-result", "run_shell", nil, "result"},
		{"too-many-displays", "run_python", nil, "displays"},
		{"empty-objects", "run_python", nil, "entries"},
		{"over-answer-bound", "run_python", nil, "too large"},
		{"oversize-frame", "run_python", nil, "too large"},
		{"invalid-json", "run_python", nil, "decoding"},
		{"wrong-types", "run_python", nil, "decoding"},
		{"frame-then-eof", "run_python", nil, ""},
		{"stalled", "list_files", nil, "no answer"},
		{"stalled", "read_file", nil, "no answer"},
		{"stopped", "write_file", map[string]any{"content": strings.Repeat("z", 1<<20)}, "no answer"},
		{"read-over-max", "read_file", nil, "bytes"},
		{"read-size-below-data", "read_file", nil, "size"},
		{"list-negative-size", "list_files", nil, "size"},
		{"list-escaping-path", "list_files", nil, "path"},
		{"list-too-many", "list_files", nil, "entries"},
	}
	b, attacker, bystander := hostileServer(t, session.ModeSession)
	if res := callWithin(t, bystander, "run_python", map[string]any{"code": "1", "session": "bystander"}); res.IsError {
		t.Fatalf("bystander: %q", text(res))
	}
	for _, c := range cases {
		t.Run(c.tool+"/"+c.name, func(t *testing.T) {
			sess := "victim-" + strings.ReplaceAll(c.tool, "_", "-") + "-" + c.name
			// An honest call first, so the case's box exists and has
			// answered once (stale-id needs an id it used).
			if res := callWithin(t, attacker, "run_shell", map[string]any{"command": "true", "session": sess}); res.IsError {
				t.Fatalf("honest call: %q", text(res))
			}
			args := map[string]any{"session": sess}
			for k, v := range c.args {
				args[k] = v
			}
			switch c.tool {
			case "run_python":
				args["code"] = "hostile/" + c.name
			case "run_shell":
				args["command"] = "hostile/" + c.name
			default:
				args["path"] = "hostile/" + c.name
			}
			res := callWithin(t, attacker, c.tool, args)
			if c.name != "duplicate" && (!res.IsError || !strings.Contains(text(res), c.want)) {
				t.Errorf("want an error result mentioning %q, got isError=%v %.300q", c.want, res.IsError, text(res))
			}
			box := b.lastHostile(t)
			select {
			case <-box.destroyed:
			case <-time.After(5 * time.Second):
				t.Errorf("the box that sent it was not destroyed")
			}
			if res := callWithin(t, bystander, "run_python", map[string]any{"code": "6 * 7", "session": "bystander"}); res.IsError || !strings.Contains(text(res), "ran: 6 * 7") {
				t.Errorf("the bystander's session: isError=%v %q", res.IsError, text(res))
			}
			// The victim's session goes on in a fresh box.
			res = callWithin(t, attacker, "run_shell", map[string]any{"command": "echo again", "session": sess})
			if res.IsError || !strings.Contains(text(res), "ran: echo again") {
				t.Errorf("the session after its box was destroyed: isError=%v %q", res.IsError, text(res))
			}
			// It says what really happened to the box: no talk of memory.
			why := "broke the agent protocol"
			switch c.want {
			case "no answer":
				why = "its agent stopped answering"
			case "":
				why = "" // not a validation fault of its own (a hang-up, a duplicate)
			}
			if got := text(res); strings.Contains(got, "memory") || !strings.Contains(got, why) {
				t.Errorf("the next call after the box was destroyed says %q, want %q", got, why)
			}
			callWithin(t, attacker, "reset_session", map[string]any{"session": sess}) // within the principal's quota
		})
	}
}

// TestHostileHello starts boxes whose first frame is not an honest hello.
func TestHostileHello(t *testing.T) {
	for _, c := range []struct {
		name  string
		hello []byte
	}{
		{"garbage", rawFrame("\x00\xffnot json")},
		{"wrong version", frame(&agentproto.Hello{Version: 99})},
		{"huge preload list", frame(&agentproto.Hello{Version: 1, Preloaded: make([]string, 100_000)})},
		{"long python version", frame(&agentproto.Hello{Version: 1, Python: strings.Repeat("3", 1<<20)})},
		{"oversize", binary.BigEndian.AppendUint32(nil, agentproto.MaxFrame+1)},
		{"hang-up", rawFrame("")[:2]},
	} {
		t.Run(c.name, func(t *testing.T) {
			b, attacker, bystander := hostileServer(t, session.ModeSession)
			b.mu.Lock()
			b.hello = c.hello
			b.mu.Unlock()
			res := callWithin(t, attacker, "run_python", map[string]any{"code": "1"})
			if !res.IsError {
				t.Errorf("a box with a bad hello ran the call: %q", text(res))
			}
			select {
			case <-b.lastHostile(t).destroyed:
			case <-time.After(5 * time.Second):
				t.Errorf("the box was not destroyed")
			}
			if res := callWithin(t, bystander, "run_python", map[string]any{"code": "2", "session": "bystander"}); res.IsError {
				t.Errorf("bystander: %q", text(res))
			}
		})
	}
}

func newAgentConn(ctx context.Context, id string, stream net.Conn, destroy func() error, timeout time.Duration) (sandbox.Sandbox, error) {
	c, err := sandbox.DialAgent(ctx, id, stream, destroy, &sandbox.AgentConnOptions{RequestTimeout: timeout})
	if err != nil {
		return nil, err
	}
	return panicky{c}, nil
}

// panicky is a box whose methods panic when asked to, standing for a bug
// of kiln's that a box's answer could trigger anywhere on a call's path.
type panicky struct{ sandbox.Sandbox }

// Err keeps the connection's reason for its death visible, as the
// backends' own wrappers do.
func (p panicky) Err() error { return p.Sandbox.(interface{ Err() error }).Err() }

func (p panicky) RunPython(ctx context.Context, code string, opts sandbox.ExecOptions) (*agentproto.ExecResult, error) {
	if code == "panic/" {
		panic("planted panic in RunPython")
	}
	return p.Sandbox.RunPython(ctx, code, opts)
}

func (p panicky) ListFiles(ctx context.Context, path string) ([]agentproto.FileInfo, error) {
	if path == "panic/" {
		panic("planted panic in ListFiles")
	}
	return p.Sandbox.ListFiles(ctx, path)
}

// TestPanicInCall plants a panic on a call's path, in the MCP handler's
// goroutine (list_files) and in the session's (run_python). Each must
// become an error result for that call and a destroyed box.
func TestPanicInCall(t *testing.T) {
	b, attacker, bystander := hostileServer(t, session.ModeSession)
	for _, c := range []struct{ tool, arg string }{{"list_files", "path"}, {"run_python", "code"}} {
		t.Run(c.tool, func(t *testing.T) {
			sess := "panic-" + strings.ReplaceAll(c.tool, "_", "-")
			if res := callWithin(t, attacker, "run_shell", map[string]any{"command": "true", "session": sess}); res.IsError {
				t.Fatal(text(res))
			}
			b.mu.Lock()
			box := b.boxes[len(b.boxes)-1]
			b.mu.Unlock()
			res := callWithin(t, attacker, c.tool, map[string]any{c.arg: "panic/", "session": sess})
			if !res.IsError || !strings.Contains(text(res), "planted panic") {
				t.Errorf("want an error result naming the panic, got isError=%v %q", res.IsError, text(res))
			}
			select {
			case <-box.destroyed:
			case <-time.After(5 * time.Second):
				t.Errorf("the box was not destroyed")
			}
			if res := callWithin(t, bystander, "run_python", map[string]any{"code": "6 * 7", "session": "bystander"}); res.IsError {
				t.Errorf("bystander: %q", text(res))
			}
			if res := callWithin(t, attacker, "run_shell", map[string]any{"command": "echo again", "session": sess}); res.IsError || !strings.Contains(text(res), "ran: echo again") {
				t.Errorf("the session afterwards: isError=%v %q", res.IsError, text(res))
			}
			callWithin(t, attacker, "reset_session", map[string]any{"session": sess})
		})
	}
}

// TestHostileAgentCuts sends what model code can make an honest agent
// send, over the bounds: it is cut with a note, not a fault, and the box
// lives on.
func TestHostileAgentCuts(t *testing.T) {
	b, attacker, _ := hostileServer(t, session.ModeSession)
	for _, c := range []struct {
		name, tool string
		want       []string
		not        string
	}{
		{"huge-error", "read_file", []string{"truncated"}, ""},
		{"huge-traceback", "run_python", []string{"truncated", "exception's text was cut"}, ""},
		{"rich-flood", "run_python", []string{"bytes of rich output"}, ""},
		{"bad-base64", "run_python", []string{"not valid base64", "<Figure>"}, ""},
		{"unknown-mime", "run_python", []string{"plain"}, "x-evil"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sess := "cut-" + c.name
			args := map[string]any{"session": sess}
			switch c.tool {
			case "run_python":
				args["code"] = "hostile/" + c.name
			default:
				args["path"] = "hostile/" + c.name
			}
			res := callWithin(t, attacker, c.tool, args)
			raw, _ := json.Marshal(res)
			if len(raw) > 12<<20 {
				t.Errorf("a result of %d bytes", len(raw))
			}
			for _, w := range c.want {
				if !strings.Contains(text(res), w) {
					t.Errorf("the result does not say %q: %.500q", w, text(res))
				}
			}
			if c.not != "" && strings.Contains(string(raw), c.not) {
				t.Errorf("the result carries %q", c.not)
			}
			if len(images(res)) != 0 {
				t.Errorf("%d image blocks", len(images(res)))
			}
			select {
			case <-b.lastHostile(t).destroyed:
				t.Errorf("a box that sent content over a bound was destroyed")
			default:
			}
			if res := callWithin(t, attacker, "run_shell", map[string]any{"command": "echo again", "session": sess}); res.IsError || strings.Contains(text(res), "new sandbox") {
				t.Errorf("the session afterwards: isError=%v %q", res.IsError, text(res))
			}
			callWithin(t, attacker, "reset_session", map[string]any{"session": sess})
		})
	}
}
