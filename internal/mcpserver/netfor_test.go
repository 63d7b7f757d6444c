package mcpserver_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/egress"
	"kiln/internal/mcpserver"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

// TestNetworkForPrincipal: the operator's allowlist for a principal
// narrows the boxes of that principal's calls, on every box it gets (a
// session's, a per-call job's), and its tools/list says what it can
// reach; another principal keeps the server's allowlist. The control is
// the other principal resolving the name the first may not.
func TestNetworkForPrincipal(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root for the jail backend and the egress gateway")
	}
	gw, err := egress.NewGateway(egress.Options{
		Hosts: map[string][]netip.Addr{
			"allowed.test": {netip.MustParseAddr("192.0.2.10")},
			"second.test":  {netip.MustParseAddr("192.0.2.11")},
		},
		TestOnlyAllowedAddrs: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")},
	})
	if err != nil {
		t.Skipf("egress gateway unavailable: %v", err)
	}
	defer gw.Close()
	server := egress.MustParsePolicy("allowed.test", "second.test")
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Egress: gw, Policy: server})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	mgr := session.NewManager(session.Options{Backend: b, DefaultTimeout: 20 * time.Second, MaxOutput: 2000, Grace: time.Second})
	defer mgr.Close()
	narrow := egress.MustParsePolicy("second.test")
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: b.Name(), Network: egress.Describe(server),
		NetworkFor: func(principal string) (mcpserver.PrincipalNetwork, bool) {
			if principal != "ci" {
				return mcpserver.PrincipalNetwork{}, false
			}
			return mcpserver.PrincipalNetwork{Hosts: narrow.Entries(), Describe: egress.Describe(narrow)}, true
		}})
	lim := testLimits()
	ciTok, devTok := strings.Repeat("c", 24), strings.Repeat("d", 24)
	ts := httptest.NewServer(srv.Handler(mcpserver.HTTPOptions{Limits: &lim,
		Tokens: []mcpserver.Token{{Principal: "ci", Secret: ciTok}, {Principal: "dev", Secret: devTok}}}))
	defer ts.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	connect := func(tok string) *mcp.ClientSession {
		cs, err := mcp.NewClient(&mcp.Implementation{Name: "t", Version: "1"}, nil).Connect(ctx,
			&mcp.StreamableClientTransport{Endpoint: ts.URL + "/mcp", HTTPClient: &http.Client{Transport: bearer{tok}}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cs.Close() })
		return cs
	}
	ci, dev := connect(ciTok), connect(devTok)
	lookup := func(cs *mcp.ClientSession, name string) string {
		t.Helper()
		r, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "run_python", Arguments: map[string]any{"code": `import socket
try:
    print("resolved", socket.gethostbyname("` + name + `"))
except OSError as e:
    print("refused", e)`}})
		if err != nil {
			t.Fatal(err)
		}
		return text(r)
	}
	if got := lookup(dev, "allowed.test"); !strings.Contains(got, "resolved") {
		t.Fatalf("control: dev (the server's allowlist) could not resolve allowed.test: %q", got)
	}
	if got := lookup(ci, "allowed.test"); !strings.Contains(got, "refused") {
		t.Errorf("ci, narrowed to second.test, resolved allowed.test: %q", got)
	}
	if got := lookup(ci, "second.test"); !strings.Contains(got, "resolved") {
		t.Errorf("ci could not resolve second.test, which its allowlist keeps: %q", got)
	}
	if got := lookup(dev, "second.test"); !strings.Contains(got, "resolved") {
		t.Errorf("dev could not resolve second.test: %q", got)
	}

	describe := func(cs *mcp.ClientSession) string {
		t.Helper()
		tools, err := cs.ListTools(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, tool := range tools.Tools {
			if tool.Name == "run_python" {
				return tool.Description
			}
		}
		t.Fatal("no run_python tool")
		return ""
	}
	if d := describe(ci); !strings.Contains(d, "these hosts over HTTP(S) (ports 80 and 443 unless a port is given): second.test.") {
		t.Errorf("ci's run_python description does not name its allowlist:\n%s", d)
	}
	if d := describe(dev); !strings.Contains(d, "allowed.test, second.test") {
		t.Errorf("dev's run_python description does not name the server's allowlist:\n%s", d)
	}
}
