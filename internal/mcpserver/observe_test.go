package mcpserver_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/event"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

type execRecorder struct {
	mu    sync.Mutex
	execs []event.Exec
}

func (r *execRecorder) Observe(e event.Event) {
	if x, ok := e.(event.Exec); ok {
		r.mu.Lock()
		r.execs = append(r.execs, x)
		r.mu.Unlock()
	}
}

// TestObservedPrincipal: over HTTP, the execution events of both modes
// name the token's principal, per-call runs included (they have no session
// to carry it).
func TestObservedPrincipal(t *testing.T) {
	for _, mode := range []session.Mode{session.ModeSession, session.ModePerCall} {
		t.Run(string(mode), func(t *testing.T) {
			rec := &execRecorder{}
			srv := serve(t, sessiontest.New(t, nil), session.Options{Mode: mode, DefaultTimeout: 20 * time.Second, Observer: rec})
			f := serveHTTP(t, srv, testLimits())
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cs, err := mcp.NewClient(&mcp.Implementation{Name: "t", Version: "1"}, nil).Connect(ctx,
				&mcp.StreamableClientTransport{Endpoint: "http://" + f.addr + "/mcp", HTTPClient: &http.Client{Transport: &countingTransport{token: f.secret}}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer cs.Close()
			res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "run_shell", Arguments: map[string]any{"command": "echo hi"}})
			if err != nil || res.IsError {
				t.Fatalf("call: %v %+v", err, res)
			}
			rec.mu.Lock()
			defer rec.mu.Unlock()
			if len(rec.execs) != 1 || rec.execs[0].Principal != "alice" || rec.execs[0].Result != event.ResultOK || rec.execs[0].Language != "shell" {
				t.Errorf("exec events: %+v", rec.execs)
			}
		})
	}
}
