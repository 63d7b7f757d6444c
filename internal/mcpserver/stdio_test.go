package mcpserver_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"

	"kiln/internal/mcpserver"
)

// TestStdioErrorKeepsID: a message the transport cannot take (longer than
// the message limit, or malformed) is answered with an error that carries
// the request's id whenever the id can be read from it, so a client
// waiting on that id gets its answer instead of hanging. The transport
// then goes on.
func TestStdioErrorKeepsID(t *testing.T) {
	huge := strings.Repeat("x", 17<<20)
	for _, c := range []struct {
		name, line string
		want       any // the id the answer must carry
	}{
		{"oversize, id first", `{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"run_python","arguments":{"code":"` + huge + `"}}}`, 7.0},
		{"oversize, id last (TypeScript SDK order)", `{"method":"tools/call","params":{"name":"run_python","arguments":{"code":"` + huge + `"}},"jsonrpc":"2.0","id":8}`, 8.0},
		{"oversize, string id", `{"jsonrpc":"2.0","id":"req-9","method":"tools/call","params":{"arguments":{"code":"` + huge + `"}}}`, "req-9"},
		{"truncated", `{"jsonrpc":"2.0","id":10,"method":`, 10.0},
		{"bad params", `{"jsonrpc":"2.0","id":11,"method":"tools/call","params":{"name":1,}}`, 11.0},
		{"no id", `{"jsonrpc":"2.0","method":` + huge, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			inR, inW := io.Pipe()
			outR, outW := io.Pipe()
			conn, err := mcpserver.NewStdioTransport(inR, outW).Connect(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			go func() {
				io.WriteString(inW, c.line+"\n")
				io.WriteString(inW, `{"jsonrpc":"2.0","id":99,"method":"ping"}`+"\n")
			}()
			br := bufio.NewReader(outR)
			line, err := br.ReadBytes('\n')
			if err != nil {
				t.Fatal(err)
			}
			var resp struct {
				ID    any `json:"id"`
				Error *struct {
					Code    int    `json:"code"`
					Message string `json:"message"`
				} `json:"error"`
			}
			if err := json.Unmarshal(line, &resp); err != nil || resp.Error == nil {
				t.Fatalf("answer %q is not an error response: %v", line, err)
			}
			if resp.ID != c.want {
				t.Errorf("error answer carries id %#v, want %#v (%s)", resp.ID, c.want, resp.Error.Message)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			msg, err := conn.Read(ctx)
			if err != nil {
				t.Fatalf("the transport stopped after the bad message: %v", err)
			}
			if r, ok := msg.(*jsonrpc.Request); !ok || r.Method != "ping" {
				t.Errorf("next message %#v, want the ping", msg)
			}
		})
	}
}
