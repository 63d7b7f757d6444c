package mcpserver_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// dial connects a new client to srv over the SDK's in-memory transports.
// Both ends are closed when the test ends; close the client sooner to
// drop it.
func dial(t testing.TB, srv *mcpserver.Server) *mcp.ClientSession {
	t.Helper()
	ct, st := mcp.NewInMemoryTransports()
	ss, err := srv.MCP().Connect(context.Background(), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "1"}, nil).Connect(context.Background(), ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// serve builds kiln's MCP server on b; the manager is closed when the
// test ends.
func serve(t testing.TB, b sandbox.Backend, opts session.Options) *mcpserver.Server {
	t.Helper()
	opts.Backend = b
	mgr := session.NewManager(opts)
	t.Cleanup(mgr.Close)
	var rt sandbox.Runtime
	if d, ok := b.(sandbox.Describer); ok {
		rt = d.Runtime()
	}
	return mcpserver.New(mcpserver.Options{Manager: mgr, Runtime: rt, Backend: b.Name()})
}

// backends are what the tests of whole calls run on: the in-process
// backend everywhere (the real agent and python kernel, no isolation, no
// root), and the jail where the tests run as root.
var backends = []struct {
	name string
	make func(t *testing.T) sandbox.Backend
}{
	{"inprocess", func(t *testing.T) sandbox.Backend {
		return sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	}},
	{"jail", func(t *testing.T) sandbox.Backend {
		if os.Getuid() != 0 {
			t.Skip("needs root for the jail backend")
		}
		b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		return b
	}},
}

// onBackends runs f once per backend, as subtests.
func onBackends(t *testing.T, f func(t *testing.T, b sandbox.Backend)) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) { f(t, be.make(t)) })
	}
}

// connect serves kiln on b with the options the tests of whole calls
// share, and returns a client.
func connect(t *testing.T, b sandbox.Backend, mode session.Mode) *mcp.ClientSession {
	t.Helper()
	return dial(t, serve(t, b, session.Options{
		Mode: mode, Preload: []string{"matplotlib"},
		DefaultTimeout: 20 * time.Second, MaxOutput: 2000, Grace: time.Second,
	}))
}
