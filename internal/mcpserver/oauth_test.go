package mcpserver_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/google/go-cmp/cmp"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/modelcontextprotocol/go-sdk/oauthex"

	"kiln/internal/mcpserver"
	"kiln/internal/oauth"
	"kiln/internal/oauth/oauthtest"
	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// oauthFixture is kiln serving /mcp as an OAuth protected resource of a
// local issuer.
type oauthFixture struct {
	iss      *oauthtest.Issuer
	url      string // of the HTTP server
	resource string
	metaURL  string
}

func serveOAuth(t *testing.T, b sandbox.Backend) *oauthFixture {
	t.Helper()
	srv := serve(t, b, session.Options{Mode: session.ModeSession, DefaultTimeout: 20 * time.Second, MaxOutput: 2000, Grace: time.Second})
	iss := oauthtest.New(t)
	f := &oauthFixture{iss: iss}
	var h http.Handler
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h.ServeHTTP(w, r) }))
	t.Cleanup(ts.Close)
	f.url = ts.URL
	f.resource = ts.URL + "/mcp"
	v, err := oauth.New(context.Background(), oauth.Config{Issuer: iss.URL, Resource: f.resource, JWKSURL: iss.JWKSURL(), MinRefetch: time.Nanosecond, Refresh: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v.Close() })
	f.metaURL, err = oauth.MetadataURL(f.resource)
	if err != nil {
		t.Fatal(err)
	}
	lim := testLimits()
	h = srv.Handler(mcpserver.HTTPOptions{Limits: &lim, OAuth: &mcpserver.OAuth{
		Verify: v.Verify, Metadata: v.Metadata(), MetadataURL: f.metaURL, Scopes: []string{"kiln:run"}, ClockSkew: v.Leeway(),
	}})
	return f
}

type bearer struct{ token string }

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return http.DefaultTransport.RoundTrip(r)
}

// TestOAuthRunsCode: a token of the issuer, for kiln's resource, with
// kiln:run, runs code through a real client; the principal is the
// token's subject, distinct per subject.
func TestOAuthRunsCode(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		f := serveOAuth(t, b)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		connectAs := func(sub string) *mcp.ClientSession {
			c := f.iss.Good(f.resource, "kiln:run")
			c.Subject = sub
			cs, err := mcp.NewClient(&mcp.Implementation{Name: "t", Version: "1"}, nil).Connect(ctx,
				&mcp.StreamableClientTransport{Endpoint: f.resource, HTTPClient: &http.Client{Transport: bearer{f.iss.Mint(t, c)}}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cs.Close() })
			return cs
		}
		alice, bob := connectAs("alice"), connectAs("bob")
		res, err := alice.CallTool(ctx, &mcp.CallToolParams{Name: "run_python", Arguments: map[string]any{"code": "secret = 6*7\nprint(secret)", "session": "s"}})
		if err != nil {
			t.Fatal(err)
		}
		if got := text(res); res.IsError || !strings.Contains(got, "42") {
			t.Fatalf("run_python: %q", got)
		}
		// bob's session "s" is his own: alice's variable is not there.
		res, err = bob.CallTool(ctx, &mcp.CallToolParams{Name: "run_python", Arguments: map[string]any{"code": "print(secret)", "session": "s"}})
		if err != nil {
			t.Fatal(err)
		}
		if got := text(res); !res.IsError || !strings.Contains(got, "NameError") {
			t.Errorf("bob sees alice's session: %q", got)
		}
	})
}

func post(t *testing.T, url, token string) *http.Response {
	t.Helper()
	body := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// TestOAuthChallenges: refused requests get 401 or 403 with a Bearer
// challenge that names the metadata and the scope, and the RFC 6750 error
// code when a token was sent.
func TestOAuthChallenges(t *testing.T) {
	f := serveOAuth(t, sessiontest.New(t, nil))
	good := f.iss.Good(f.resource, "kiln:run")
	with := func(e func(*oauthtest.Claims)) string {
		c := good
		e(&c)
		return f.iss.Mint(t, c)
	}
	other := oauthtest.New(t)
	for _, c := range []struct {
		name   string
		token  string
		status int
		err    string
	}{
		{"no token", "", http.StatusUnauthorized, ""},
		{"expired", with(func(c *oauthtest.Claims) { c.Expiry = time.Now().Add(-time.Hour) }), http.StatusUnauthorized, "invalid_token"},
		{"wrong audience", with(func(c *oauthtest.Claims) { c.Audience = []string{"https://elsewhere.example/mcp"} }), http.StatusUnauthorized, "invalid_token"},
		{"wrong issuer", oauthtest.MintWith(t, other.Key(), func() oauthtest.Claims { c := good; c.Issuer = other.URL; return c }()), http.StatusUnauthorized, "invalid_token"},
		{"static-looking token", strings.Repeat("s", 32), http.StatusUnauthorized, "invalid_token"},
		{"no kiln:run", with(func(c *oauthtest.Claims) { c.Scope = "openid profile" }), http.StatusForbidden, "insufficient_scope"},
		{"no scope", with(func(c *oauthtest.Claims) { c.Scope = "" }), http.StatusForbidden, "insufficient_scope"},
		{"good", f.iss.Mint(t, good), http.StatusOK, ""},
		{"expired within the leeway", with(func(c *oauthtest.Claims) { c.Expiry = time.Now().Add(-5 * time.Second) }), http.StatusOK, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			resp := post(t, f.resource, c.token)
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d", resp.StatusCode, c.status)
			}
			if c.status == http.StatusOK {
				return
			}
			chs, err := oauthex.ParseWWWAuthenticate(resp.Header.Values("WWW-Authenticate"))
			if err != nil || len(chs) != 1 || chs[0].Scheme != "bearer" {
				t.Fatalf("WWW-Authenticate %q: %v", resp.Header.Values("WWW-Authenticate"), err)
			}
			want := map[string]string{"resource_metadata": f.metaURL, "scope": "kiln:run"}
			if c.err != "" {
				want["error"] = c.err
			}
			if diff := cmp.Diff(want, chs[0].Params); diff != "" {
				t.Errorf("challenge params (-want +got):\n%s", diff)
			}
		})
	}
	for name, tok := range f.iss.Forgeries(t, good) {
		t.Run("forged: "+name, func(t *testing.T) {
			resp := post(t, f.resource, tok)
			if resp.StatusCode != http.StatusUnauthorized {
				t.Fatalf("status %d, want 401", resp.StatusCode)
			}
			if h := resp.Header.Get("WWW-Authenticate"); !strings.Contains(h, `error="invalid_token"`) {
				t.Errorf("WWW-Authenticate %q", h)
			}
		})
	}
	t.Run("rotation", func(t *testing.T) {
		old := f.iss.Mint(t, good)
		f.iss.Rotate(t, jose.ES256, false)
		if resp := post(t, f.resource, f.iss.Mint(t, f.iss.Good(f.resource, "kiln:run"))); resp.StatusCode != http.StatusOK {
			t.Errorf("a token of the new key: status %d", resp.StatusCode)
		}
		if resp := post(t, f.resource, old); resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("a token of the removed key: status %d", resp.StatusCode)
		}
	})
}

// TestOAuthMetadata: the RFC 9728 document is served at the well-known
// path and at its path-suffixed form, names kiln's resource, its issuer
// and its scopes, and passes the SDK client's own checks.
func TestOAuthMetadata(t *testing.T) {
	f := serveOAuth(t, sessiontest.New(t, nil))
	for _, u := range []string{f.url + "/.well-known/oauth-protected-resource", f.metaURL} {
		resp, err := http.Get(u)
		if err != nil {
			t.Fatal(err)
		}
		var got map[string]any
		err = json.NewDecoder(resp.Body).Decode(&got)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d %v", u, resp.StatusCode, err)
		}
		want := map[string]any{
			"resource":                 f.resource,
			"authorization_servers":    []any{f.iss.URL},
			"scopes_supported":         []any{"kiln:run", "kiln:net"},
			"bearer_methods_supported": []any{"header"},
			"resource_name":            "kiln sandbox",
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("GET %s (-want +got):\n%s", u, diff)
		}
		if _, err := oauthex.GetProtectedResourceMetadata(context.Background(), u, f.resource, http.DefaultClient); err != nil {
			t.Errorf("the SDK client refuses it: %v", err)
		}
	}
}

// TestOAuthNetScope: on a server with an allowlist, a client whose token
// lacks kiln:net runs in a box cut off from the network, in session and
// per-call mode; a session box a permitted call used is cut before an
// unpermitted call of the same principal runs in it.
func TestOAuthNetScope(t *testing.T) {
	b := netScopeJail(t)
	for _, mode := range []session.Mode{session.ModeSession, session.ModePerCall} {
		t.Run(string(mode), func(t *testing.T) {
			mgr := session.NewManager(session.Options{Backend: b, Mode: mode, DefaultTimeout: 20 * time.Second, MaxOutput: 2000, Grace: time.Second})
			t.Cleanup(mgr.Close)
			f := newScopedHTTP(t)
			f.serve(mgr, b.Name())

			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			run := func(scope string) string {
				t.Helper()
				cs := f.connect(t, ctx, scope)
				args := map[string]any{"code": lookupCode}
				if mode == session.ModeSession {
					args["session"] = "s"
				}
				r, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "run_python", Arguments: args})
				if err != nil {
					t.Fatal(err)
				}
				return text(r)
			}
			if got := run("kiln:run kiln:net"); !strings.Contains(got, "resolved 192.0.2.10") {
				t.Fatalf("with kiln:net the allowed name does not resolve: %q", got)
			}
			got := run("kiln:run")
			if !strings.Contains(got, "refused") || strings.Contains(got, "resolved") {
				t.Fatalf("without kiln:net the box reached the network: %q", got)
			}
			if !strings.Contains(got, "not allowed to use it") {
				t.Errorf("the result does not tell the model why: %q", got)
			}
		})
	}
}

// TestOAuthRefusedBodyNotRead: as with static tokens, a request with a
// bad token (or a metadata request) is answered without its body being
// read, and its connection is closed.
func TestOAuthRefusedBodyNotRead(t *testing.T) {
	f := serveOAuth(t, sessiontest.New(t, nil))
	addr := strings.TrimPrefix(f.url, "http://")
	for _, c := range []struct{ name, head string }{
		{"bad token", "POST /mcp HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer " + f.iss.Mint(t, f.iss.Good("https://elsewhere.example/mcp", "kiln:run")) + "\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"},
		{"metadata", "GET /.well-known/oauth-protected-resource/mcp HTTP/1.1\r\nHost: %s\r\nContent-Length: 100000\r\n\r\n{"},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			fmt.Fprintf(conn, c.head, addr) // the body never comes
			conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				t.Fatalf("no answer while the body is still due: %v", err)
			}
			resp.Body.Close()
			if !resp.Close {
				t.Errorf("status %d keeps the connection", resp.StatusCode)
			}
			if !waitClosed(conn, 10*time.Second) {
				t.Error("the server kept the connection open")
			}
		})
	}
}
