package mcpserver

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/session"
)

// FuzzRenderFrame feeds what a hostile box could write on its stream
// through the host's whole path: decode (agentproto.ReadFrame), validate
// (Response.Check, as AgentConn does) and render the tool result. Nothing
// may panic; a frame that passes validation must render to a result of
// valid UTF-8 that encodes to JSON within what a client accepts.
//
//	go test ./internal/mcpserver -run '^$' -fuzz FuzzRenderFrame -fuzztime 5m
func FuzzRenderFrame(f *testing.F) {
	exec := func(res string) string { return `{"id":1,"exec":` + res + `}` }
	for _, seed := range []string{
		exec(`{"stdout":{"text":"hello","total":10,"cut":-1},"stderr":{"text":"","total":0}}`),
		exec(`{"stdout":{"text":"hello","total":10,"cut":99},"stderr":{"text":"","total":0}}`),
		exec(`{"stdout":{"text":"hello","total":-10,"cut":2},"stderr":{"text":"x","total":1}}`),
		exec(`{"stdout":{"text":"h\u00e9llo","total":100,"cut":2},"stderr":{"text":"","total":0}}`),
		exec(`{"stdout":{"text":"` + "\xff\xfe\xc3" + `","total":3,"cut":1},"stderr":{"text":"\ud800","total":1}}`),
		exec(`{"stdout":{"text":"","total":0},"stderr":{"text":"","total":0},"displays":[` + strings.Repeat(`{"text/plain":"x"},`, 100) + `{}]}`),
		exec(`{"stdout":{"text":"","total":0},"stderr":{"text":"","total":0},"displays":[` + strings.Repeat(`{},`, 5000) + `{}]}`),
		exec(`{"stdout":{"text":"","total":0},"stderr":{"text":"","total":0},"displays":[{"image/png":"!!not base64","text/plain":"fig"}]}`),
		exec(`{"stdout":{"text":"","total":0},"stderr":{"text":"","total":0},"displays":[{"image/png":"iVBORw0KGgo=","text/plain":"fig"}],"result":{"text/html":"<b>x</b>","text/x-kiln-note":"dropped"}}`),
		exec(`{"stdout":{"text":"","total":0},"stderr":{"text":"","total":0},"result":{"application/x-evil":"x","text/plain":null,"text/markdown":5}}`),
		exec(`{"stdout":{"text":"","total":0},"stderr":{"text":"","total":0},"error":{"ename":"E","evalue":"v","traceback":"` + "\x1b[2J" + `"},"exit_code":-1,"signal":"SIGKILL"}`),
		exec(`{"stdout":{"text":"","total":0,"cut":1e30},"stderr":{"text":"","total":0}}`),
		exec(`{"stdout":{"text":5}}`),
		exec(`null`),
		`{"id":1}`,
		`{"id":1,"error":"` + strings.Repeat("e", 100) + `"}`,
		`{"id":1,"data":"AAAA","size":-1}`,
		`{"id":1,"files":[{"path":"../x","size":1}]}`,
		`{"id":2,"exec":{}}`,
		`[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]`,
		`not json`,
	} {
		f.Add(seed, uint8(0))
	}
	ops := []string{agentproto.OpPython, agentproto.OpShell, agentproto.OpRead, agentproto.OpList, agentproto.OpChanges, agentproto.OpWrite}
	s := &Server{}
	f.Fuzz(func(t *testing.T, body string, op uint8) {
		var buf bytes.Buffer
		binary.Write(&buf, binary.BigEndian, uint32(len(body)))
		buf.WriteString(body)
		var resp agentproto.Response
		if agentproto.ReadFrame(&buf, &resp) != nil {
			return
		}
		req := agentproto.Request{ID: 1, Op: ops[int(op)%len(ops)], MaxOutput: 100, MaxBytes: 64}
		if resp.Check(&req) != nil {
			return
		}
		var res *mcp.CallToolResult
		switch req.Op {
		case agentproto.OpPython, agentproto.OpShell:
			if resp.Exec == nil {
				return
			}
			res = s.render(&session.Outcome{ExecResult: resp.Exec, Session: "fuzz"}, nil)
		case agentproto.OpRead:
			res = fileResult("header", "f", resp.Data)
		default:
			return
		}
		for _, c := range res.Content {
			if tc, ok := c.(*mcp.TextContent); ok && !utf8.ValidString(tc.Text) {
				t.Fatalf("invalid UTF-8 in the result: %q", tc.Text)
			}
		}
		b, err := json.Marshal(res)
		if err != nil {
			t.Fatalf("encoding the result: %v", err)
		}
		if len(b) > mcp.DefaultMaxLineLength {
			t.Fatalf("a result of %d bytes", len(b))
		}
	})
}
