package mcpserver_test

import (
	"context"
	"encoding/json"
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
	"kiln/internal/oauth"
	"kiln/internal/oauth/oauthtest"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

// atLoad is state whose unpickling looks the allowed name up and writes
// what it saw to /work/at-load: code the model chose, run while a box
// loads a snapshot or a hibernated session, before any call runs in it.
const atLoad = `class Probe:
    def __reduce__(self):
        return (exec, ("import socket\ntry:\n    socket.gethostbyname('allowed.test'); open('/work/at-load', 'w').write('resolved')\nexcept OSError:\n    open('/work/at-load', 'w').write('refused')",))
probe = Probe()`

const lookupCode = `import socket
try:
    print("resolved", socket.gethostbyname("allowed.test"))
except OSError as e:
    print("refused", e)`

// netScopeJail is a jail whose boxes may reach allowed.test (192.0.2.10)
// through a real egress gateway; the test skips where it cannot run.
func netScopeJail(t *testing.T) *jail.Backend {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root for the jail backend and the egress gateway")
	}
	gw, err := egress.NewGateway(egress.Options{
		Hosts:                map[string][]netip.Addr{"allowed.test": {netip.MustParseAddr("192.0.2.10")}},
		TestOnlyAllowedAddrs: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")},
	})
	if err != nil {
		t.Skipf("egress gateway unavailable: %v", err)
	}
	t.Cleanup(func() { gw.Close() })
	policy, err := egress.ParsePolicy("allowed.test")
	if err != nil {
		t.Fatal(err)
	}
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Egress: gw, Policy: policy})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// scopedHTTP is /mcp as an OAuth protected resource of a local issuer,
// with NetScope "kiln:net", serving whichever manager serve was last given.
type scopedHTTP struct {
	iss *oauthtest.Issuer
	v   *oauth.Verifier
	res string
	h   http.Handler
}

func newScopedHTTP(t *testing.T) *scopedHTTP {
	t.Helper()
	f := &scopedHTTP{iss: oauthtest.New(t)}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { f.h.ServeHTTP(w, r) }))
	t.Cleanup(ts.Close)
	f.res = ts.URL + "/mcp"
	v, err := oauth.New(context.Background(), oauth.Config{Issuer: f.iss.URL, Resource: f.res, JWKSURL: f.iss.JWKSURL(), Refresh: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v.Close() })
	f.v = v
	return f
}

// serve puts a server of mgr, whose boxes may reach allowed.test, behind
// the endpoint.
func (f *scopedHTTP) serve(mgr *session.Manager, backend string) {
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: backend, Network: "allowed.test", NetScope: "kiln:net"})
	lim := testLimits()
	f.h = srv.Handler(mcpserver.HTTPOptions{Limits: &lim, OAuth: &mcpserver.OAuth{Verify: f.v.Verify, Metadata: f.v.Metadata(), Scopes: []string{"kiln:run"}}})
}

// connect is a client whose token has scope; the test closes it.
func (f *scopedHTTP) connect(t *testing.T, ctx context.Context, scope string) *mcp.ClientSession {
	t.Helper()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "t", Version: "1"}, nil).Connect(ctx,
		&mcp.StreamableClientTransport{Endpoint: f.res, HTTPClient: &http.Client{Transport: bearer{f.iss.Mint(t, f.iss.Good(f.res, scope))}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// TestNetScopeEveryPath: a token without kiln:net gets no network on any
// path that makes or wakes a box, not only in a foreground run_python: a
// background job (session and per-call), fork_session and restore_session
// (whose new box loads model-chosen state), a session resumed from
// hibernation, and resources/read, which wakes a hibernated session. The
// control is the same path with kiln:net, which must resolve the name.
func TestNetScopeEveryPath(t *testing.T) {
	b := netScopeJail(t)
	f := newScopedHTTP(t)
	state := t.TempDir()
	serve := func(mode session.Mode) *session.Manager {
		opts := session.Options{Backend: b, Mode: mode, DefaultTimeout: 20 * time.Second, MaxOutput: 2000, Grace: time.Second}
		if mode == session.ModeSession {
			opts.Snapshots = session.SnapshotOptions{StateDir: state}
			opts.Hibernate = session.HibernateOptions{Dir: state + "/hibernated", CheckpointEvery: -1}
		}
		mgr := session.NewManager(opts)
		f.serve(mgr, b.Name())
		return mgr
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	connect := func(scope string) *mcp.ClientSession { return f.connect(t, ctx, scope) }
	call := func(cs *mcp.ClientSession, tool string, args map[string]any) string {
		t.Helper()
		r, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
		if err != nil {
			t.Fatalf("%s: %v", tool, err)
		}
		return text(r)
	}
	// job runs lookupCode as a background job and waits for its result.
	job := func(cs *mcp.ClientSession, args map[string]any) string {
		t.Helper()
		args["code"], args["background"] = lookupCode, true
		r, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "run_python", Arguments: args})
		if err != nil {
			t.Fatal(err)
		}
		var started struct {
			Job string `json:"job"`
		}
		if b, _ := json.Marshal(r.StructuredContent); json.Unmarshal(b, &started) != nil || started.Job == "" {
			t.Fatalf("no job started: %s", text(r))
		}
		return call(cs, "job_status", map[string]any{"job": started.Job, "wait_s": 30})
	}
	// outcome is what the box saw: "resolved", "refused", or the text.
	outcome := func(got string) string {
		switch {
		case strings.Contains(got, "resolved"):
			return "resolved"
		case strings.Contains(got, "refused"):
			return "refused"
		}
		return got
	}
	check := func(path, scope, got string) {
		t.Helper()
		want := "refused"
		if strings.Contains(scope, "kiln:net") {
			want = "resolved"
		}
		if o := outcome(got); o != want {
			if want == "resolved" {
				t.Errorf("%s with kiln:net (the control): %q, want the allowed name resolved", path, got)
			} else {
				t.Errorf("%s without kiln:net: the box reached the network: %q", path, got)
			}
		}
	}
	readFile := func(cs *mcp.ClientSession, sess string) string {
		return call(cs, "read_file", map[string]any{"session": sess, "path": "at-load"})
	}

	t.Run("per-call job", func(t *testing.T) {
		mgr := serve(session.ModePerCall)
		defer mgr.Close()
		for _, scope := range []string{"kiln:run kiln:net", "kiln:run"} {
			check("a per-call background job", scope, job(connect(scope), map[string]any{}))
		}
	})

	mgr := serve(session.ModeSession)
	net, off := connect("kiln:run kiln:net"), connect("kiln:run")
	// The state every path below loads: made with the network, as a
	// permitted client of the same principal would.
	for _, s := range []string{"src", "h1", "h2"} {
		if got := call(net, "run_python", map[string]any{"session": s, "code": atLoad}); strings.Contains(got, "Error") {
			t.Fatalf("setting up %s: %s", s, got)
		}
	}
	if got := call(net, "snapshot_session", map[string]any{"session": "src", "name": "snap"}); !strings.Contains(got, "snap") {
		t.Fatalf("snapshot: %s", got)
	}
	t.Run("session job", func(t *testing.T) {
		check("a background job in a session", "kiln:run kiln:net", job(net, map[string]any{"session": "jn"}))
		check("a background job in a session", "kiln:run", job(off, map[string]any{"session": "jo"}))
	})
	t.Run("fork", func(t *testing.T) {
		for i, cs := range []*mcp.ClientSession{net, off} {
			scope := []string{"kiln:run kiln:net", "kiln:run"}[i]
			dst := []string{"fork-n", "fork-o"}[i]
			call(cs, "fork_session", map[string]any{"session": "src", "new_session": dst})
			check("fork_session", scope, readFile(cs, dst))
		}
	})
	t.Run("restore", func(t *testing.T) {
		for i, cs := range []*mcp.ClientSession{net, off} {
			scope := []string{"kiln:run kiln:net", "kiln:run"}[i]
			call(cs, "restore_session", map[string]any{"session": "src", "name": "snap"})
			check("restore_session", scope, readFile(cs, "src"))
		}
	})

	// A restart: Close hibernates every session, the next manager wakes
	// them from disk.
	mgr.Close()
	mgr = serve(session.ModeSession)
	defer mgr.Close()
	net, off = connect("kiln:run kiln:net"), connect("kiln:run")
	t.Run("resume", func(t *testing.T) {
		call(off, "run_python", map[string]any{"session": "h1", "code": "1"})
		check("a session resumed from hibernation", "kiln:run", readFile(off, "h1"))
	})
	t.Run("resources/read", func(t *testing.T) {
		r, err := off.ReadResource(ctx, &mcp.ReadResourceParams{URI: "kiln://h2/files/at-load"})
		if err != nil {
			t.Fatalf("reading the resource: %v", err)
		}
		if len(r.Contents) != 1 {
			t.Fatalf("resource: %+v", r)
		}
		check("resources/read of a hibernated session", "kiln:run", r.Contents[0].Text+string(r.Contents[0].Blob))
	})
}
