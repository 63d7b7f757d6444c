package mcpserver_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"kiln/internal/mcpserver"
	"kiln/internal/session"
)

func TestCheckListen(t *testing.T) {
	tok := []mcpserver.Token{{Principal: "a", Secret: strings.Repeat("x", 20)}}
	for _, c := range []struct {
		addr   string
		tokens []mcpserver.Token
		ok     bool
	}{
		{"127.0.0.1:8080", nil, true},
		{"[::1]:8080", nil, true},
		{"localhost:8080", nil, true},
		{"0.0.0.0:8080", nil, false},
		{":8080", nil, false},
		{"192.168.1.5:8080", nil, false},
		{"0.0.0.0:8080", tok, true},
	} {
		if err := mcpserver.CheckListen(c.addr, c.tokens); (err == nil) != c.ok {
			t.Errorf("CheckListen(%q, %d tokens) = %v", c.addr, len(c.tokens), err)
		}
	}
}

func TestLoadTokensRejectsShort(t *testing.T) {
	if _, err := mcpserver.LoadTokens("short", ""); err == nil {
		t.Error("a 5-character token was accepted")
	}
	toks, err := mcpserver.LoadTokens(strings.Repeat("k", 24), "")
	if err != nil || len(toks) != 1 || !strings.HasPrefix(toks[0].Principal, "token-") {
		t.Errorf("%v %v", toks, err)
	}
}

func TestHTTPNeedsToken(t *testing.T) {
	mgr := session.NewManager(session.Options{Backend: nil, PoolSize: 0})
	defer mgr.Close()
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: "none"})
	secret := strings.Repeat("s", 32)
	ts := httptest.NewServer(srv.Handler(mcpserver.HTTPOptions{Tokens: []mcpserver.Token{{Principal: "alice", Secret: secret}}}))
	defer ts.Close()
	body := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`
	for _, c := range []struct {
		auth string
		want int
	}{
		{"", http.StatusUnauthorized},
		{"Bearer wrong-token-wrong-token", http.StatusUnauthorized},
		{"Bearer " + secret, http.StatusOK},
	} {
		req, _ := http.NewRequest("POST", ts.URL+"/mcp", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		if c.auth != "" {
			req.Header.Set("Authorization", c.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("auth %q: status %d, want %d", c.auth, resp.StatusCode, c.want)
		}
	}
}
