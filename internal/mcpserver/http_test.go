package mcpserver_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kiln/internal/config"
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

// TestLoadTokensReservedPrincipals: a token may not name the principal of
// the stdio client and of unauthenticated loopback ("local"), nor none
// (which the server would take for "local" too): its holder would share
// that principal's sessions, snapshots and hibernated state in a state
// directory both servers use.
func TestLoadTokensReservedPrincipals(t *testing.T) {
	secret := strings.Repeat("k", 24)
	for _, line := range []string{"local:" + secret, ":" + secret, " local :" + secret} {
		if toks, err := mcpserver.LoadTokens(line, ""); err == nil {
			t.Errorf("token line %q accepted as principal %q", line, toks[0].Principal)
		} else if !strings.Contains(err.Error(), "principal") {
			t.Errorf("token line %q: %v, want an error that names the principal", line, err)
		}
	}
	if _, err := mcpserver.LoadTokens("alice:"+secret, ""); err != nil {
		t.Errorf("an ordinary principal: %v", err)
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

// TestLoadTokensFileMode: like ssh with a private key, a token file that
// its group or others can read is refused, and the error says how to fix
// it.
func TestLoadTokensFileMode(t *testing.T) {
	for _, c := range []struct {
		mode os.FileMode
		ok   bool
	}{
		{0o600, true},
		{0o400, true},
		{0o640, false},
		{0o604, false},
		{0o644, false},
		{0o660, false},
	} {
		p := filepath.Join(t.TempDir(), "tokens")
		if err := os.WriteFile(p, []byte("alice:"+strings.Repeat("t", 32)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, c.mode); err != nil {
			t.Fatal(err)
		}
		toks, err := mcpserver.LoadTokens("", p)
		if c.ok && (err != nil || len(toks) != 1) {
			t.Errorf("mode %04o: %v", c.mode, err)
		}
		if !c.ok {
			if err == nil {
				t.Errorf("a token file with mode %04o was accepted", c.mode)
			} else if !strings.Contains(err.Error(), "chmod 600") {
				t.Errorf("mode %04o: the error does not say how to fix it: %v", c.mode, err)
			}
		}
	}
}

// TestLoadTokensFileOwner: a token file of another user is refused even
// when its mode is private, as the configuration file is: whoever owns
// it can add a token. The error names the file, its owner and mode, and
// the fix.
func TestLoadTokensFileOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("giving a file to another uid needs root")
	}
	p := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(p, []byte("alice:"+strings.Repeat("t", 32)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, 4242, 4242); err != nil {
		t.Fatal(err)
	}
	_, err := mcpserver.LoadTokens("", p)
	if !errors.Is(err, config.ErrUnsafeFile) {
		t.Fatalf("a token file of uid 4242: err = %v, want ErrUnsafeFile", err)
	}
	for _, want := range []string{p, "uid 4242", "0600", "chown"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not name %q: %v", want, err)
		}
	}
}
