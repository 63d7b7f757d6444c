package oauth_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/google/go-cmp/cmp"
	"github.com/modelcontextprotocol/go-sdk/auth"

	"kiln/internal/config"
	"kiln/internal/oauth"
	"kiln/internal/oauth/oauthtest"
)

const resource = "https://kiln.example/mcp"

func newVerifier(t *testing.T, iss *oauthtest.Issuer, edit func(*oauth.Config)) *oauth.Verifier {
	t.Helper()
	cfg := oauth.Config{Issuer: iss.URL, Resource: resource, JWKSURL: iss.JWKSURL(), Refresh: -1}
	if edit != nil {
		edit(&cfg)
	}
	v, err := oauth.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v.Close() })
	return v
}

func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

// handMade builds a compact JWS from a header, a payload and a signature
// function, so tests can forge what a library would refuse to sign.
func handMade(header map[string]any, payload []byte, sign func(input string) []byte) string {
	h, _ := json.Marshal(header)
	input := b64(h) + "." + b64(payload)
	return input + "." + b64(sign(input))
}

func hs256(secret []byte) func(string) []byte {
	return func(input string) []byte {
		m := hmac.New(sha256.New, secret)
		m.Write([]byte(input))
		return m.Sum(nil)
	}
}

func TestVerify(t *testing.T) {
	iss := oauthtest.New(t)
	v := newVerifier(t, iss, nil)
	good := iss.Good(resource, "kiln:run kiln:net")
	key := iss.Key()
	pub := key.Public()
	der, err := x509.MarshalPKIXPublicKey(pub.Key)
	if err != nil {
		t.Fatal(err)
	}
	pemKey := pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})
	jwkJSON, _ := json.Marshal(pub)

	tamper := func(tok string) string {
		parts := strings.Split(tok, ".")
		sig, _ := base64.RawURLEncoding.DecodeString(parts[2])
		sig[len(sig)/2] ^= 1
		return parts[0] + "." + parts[1] + "." + b64(sig)
	}
	swapPayload := func(tok string, c oauthtest.Claims) string {
		parts := strings.Split(tok, ".")
		return parts[0] + "." + b64(c.Payload()) + "." + parts[2]
	}
	with := func(f func(*oauthtest.Claims)) oauthtest.Claims {
		c := good
		f(&c)
		return c
	}
	now := time.Now()
	other := oauthtest.New(t) // an issuer kiln does not trust

	for _, c := range []struct {
		name  string
		token string
	}{
		{"expired", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Expiry = now.Add(-2 * time.Minute) }))},
		{"not yet valid", iss.Mint(t, with(func(c *oauthtest.Claims) { c.NotBefore = now.Add(5 * time.Minute) }))},
		{"issued in the future", iss.Mint(t, with(func(c *oauthtest.Claims) { c.IssuedAt = now.Add(5 * time.Minute) }))},
		{"no expiry", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Expiry = time.Time{} }))},
		{"wrong audience", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Audience = []string{"https://other.example/mcp"} }))},
		{"audience a prefix", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Audience = []string{"https://kiln.example"} }))},
		{"no audience", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Audience = nil }))},
		{"wrong issuer", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Issuer = other.URL }))},
		{"no issuer", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Issuer = "" }))},
		{"no subject", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Subject = "" }))},
		{"subject with control characters", iss.Mint(t, with(func(c *oauthtest.Claims) { c.Subject = "alice\x1b[2J" }))},
		{"signed by another issuer's key", oauthtest.MintWith(t, other.Key(), good)},
		{"unsigned", func() string {
			h, _ := json.Marshal(map[string]any{"alg": "RS256", "kid": key.KeyID})
			return b64(h) + "." + b64(good.Payload()) + "."
		}()},
		{"alg none", handMade(map[string]any{"alg": "none", "kid": key.KeyID}, good.Payload(), func(string) []byte { return nil })},
		{"alg none, capitals", handMade(map[string]any{"alg": "None"}, good.Payload(), func(string) []byte { return nil })},
		{"HS256 with the public key (DER) as secret", handMade(map[string]any{"alg": "HS256", "kid": key.KeyID}, good.Payload(), hs256(der))},
		{"HS256 with the public key (PEM) as secret", handMade(map[string]any{"alg": "HS256", "kid": key.KeyID}, good.Payload(), hs256(pemKey))},
		{"HS256 with the JWK as secret", handMade(map[string]any{"alg": "HS256"}, good.Payload(), hs256(jwkJSON))},
		{"unknown kid", handMade(map[string]any{"alg": "RS256", "kid": "key-999"}, good.Payload(), func(string) []byte { return make([]byte, 256) })},
		{"tampered signature", tamper(iss.Mint(t, good))},
		{"payload swapped under a good signature", swapPayload(iss.Mint(t, with(func(c *oauthtest.Claims) { c.Subject = "bob" })), good)},
		{"not a JWT", "kiln-static-token-kiln-static-token"},
		{"JWE-shaped", "a.b.c.d.e"},
		{"huge", strings.Repeat("a", 20<<10) + "." + b64(good.Payload()) + ".x"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ti, err := v.Verify(context.Background(), c.token, nil)
			if err == nil {
				t.Fatalf("accepted: %+v", ti)
			}
			if !errors.Is(err, auth.ErrInvalidToken) {
				t.Errorf("error %v does not wrap auth.ErrInvalidToken (the SDK would answer 500, not 401)", err)
			}
		})
	}

	t.Run("good", func(t *testing.T) {
		ti, err := v.Verify(context.Background(), iss.Mint(t, good), nil)
		if err != nil {
			t.Fatal(err)
		}
		if want := "oidc:" + iss.URL + "#alice"; ti.UserID != want {
			t.Errorf("principal %q, want %q", ti.UserID, want)
		}
		if diff := cmp.Diff([]string{"kiln:run", "kiln:net"}, ti.Scopes); diff != "" {
			t.Errorf("scopes (-want +got):\n%s", diff)
		}
		if ti.Expiration.Unix() != good.Expiry.Unix() {
			t.Errorf("expiration %v, want %v", ti.Expiration, good.Expiry)
		}
	})
	t.Run("audience with a trailing slash", func(t *testing.T) {
		if _, err := v.Verify(context.Background(), iss.Mint(t, with(func(c *oauthtest.Claims) { c.Audience = []string{resource + "/"} })), nil); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("expired within the leeway", func(t *testing.T) {
		if _, err := v.Verify(context.Background(), iss.Mint(t, with(func(c *oauthtest.Claims) { c.Expiry = now.Add(-5 * time.Second) })), nil); err != nil {
			t.Fatal(err)
		}
	})
}

// TestAlgorithmAllowlist: an ES256 key of the issuer is refused until
// ES256 is allowed, and HMAC can never be allowed.
func TestAlgorithmAllowlist(t *testing.T) {
	iss := oauthtest.New(t)
	iss.Rotate(t, jose.ES256, false)
	tok := iss.Mint(t, iss.Good(resource, "kiln:run"))
	rsOnly := newVerifier(t, iss, func(c *oauth.Config) { c.Algorithms = []string{"RS256"} })
	if _, err := rsOnly.Verify(context.Background(), tok, nil); err == nil {
		t.Error("an ES256 token was accepted with only RS256 allowed")
	}
	if _, err := newVerifier(t, iss, nil).Verify(context.Background(), tok, nil); err != nil {
		t.Errorf("ES256 with the default algorithms: %v", err)
	}
	for _, alg := range []string{"HS256", "none", "RSA-OAEP"} {
		_, err := oauth.New(context.Background(), oauth.Config{Issuer: iss.URL, Resource: resource, JWKSURL: iss.JWKSURL(), Algorithms: []string{alg}})
		if !errors.Is(err, oauth.ErrConfig) {
			t.Errorf("algorithm %s: %v, want a configuration error", alg, err)
		}
	}
}

// TestRotation: a key added to the issuer's set is fetched when a token
// names it; a key removed from the set stops verifying once the set is
// fetched again.
func TestRotation(t *testing.T) {
	iss := oauthtest.New(t)
	v := newVerifier(t, iss, func(c *oauth.Config) { c.MinRefetch = time.Nanosecond })
	oldTok := iss.Mint(t, iss.Good(resource, "kiln:run"))
	if _, err := v.Verify(context.Background(), oldTok, nil); err != nil {
		t.Fatal(err)
	}
	iss.Rotate(t, jose.RS256, true)
	newTok := iss.Mint(t, iss.Good(resource, "kiln:run"))
	if _, err := v.Verify(context.Background(), newTok, nil); err != nil {
		t.Fatalf("the new key was not fetched: %v", err)
	}
	if _, err := v.Verify(context.Background(), oldTok, nil); err != nil {
		t.Fatalf("the old key, still published, was refused: %v", err)
	}
	iss.Rotate(t, jose.ES256, false) // every earlier key leaves the set
	newest := iss.Mint(t, iss.Good(resource, "kiln:run"))
	if _, err := v.Verify(context.Background(), newest, nil); err != nil {
		t.Fatalf("the newest key was not fetched: %v", err)
	}
	for name, tok := range map[string]string{"old": oldTok, "new": newTok} {
		if _, err := v.Verify(context.Background(), tok, nil); err == nil {
			t.Errorf("a token of the removed %s key was accepted", name)
		}
	}
}

// TestPeriodicRefresh: with no token asking, the set is still fetched
// again every Refresh, so a removed key stops verifying.
func TestPeriodicRefresh(t *testing.T) {
	iss := oauthtest.New(t)
	v := newVerifier(t, iss, func(c *oauth.Config) { c.Refresh = 10 * time.Millisecond; c.MinRefetch = time.Hour })
	tok := iss.Mint(t, iss.Good(resource, "kiln:run"))
	if _, err := v.Verify(context.Background(), tok, nil); err != nil {
		t.Fatal(err)
	}
	iss.Rotate(t, jose.RS256, false)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := v.Verify(context.Background(), tok, nil); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the removed key still verifies after 10s of 10ms refreshes")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestUnknownKidIsRateLimited: tokens with made-up key ids cost at most
// one fetch of the key set per MinRefetch.
func TestUnknownKidIsRateLimited(t *testing.T) {
	iss := oauthtest.New(t)
	v := newVerifier(t, iss, func(c *oauth.Config) { c.MinRefetch = time.Hour })
	before := iss.Fetches()
	good := iss.Good(resource, "kiln:run")
	for i := range 200 {
		tok := handMade(map[string]any{"alg": "RS256", "kid": "made-up-" + string(rune('a'+i%26))}, good.Payload(), func(string) []byte { return make([]byte, 256) })
		if _, err := v.Verify(context.Background(), tok, nil); err == nil {
			t.Fatal("a made-up kid was accepted")
		}
	}
	if n := iss.Fetches() - before; n > 0 {
		t.Errorf("%d fetches of the key set for 200 unknown kids within MinRefetch of the first fetch; want 0", n)
	}
}

// TestJWKSBounds: a key set that is too large, symmetric, or served
// slowly is refused at start, and a failed refresh keeps the old keys.
func TestJWKSBounds(t *testing.T) {
	iss := oauthtest.New(t)
	serve := func(h http.HandlerFunc) string {
		ts := httptest.NewServer(h)
		t.Cleanup(ts.Close)
		return ts.URL
	}
	huge := serve(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"keys":[` + strings.Repeat(" ", 2<<20) + `]}`))
	})
	symmetric := serve(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"keys":[{"kty":"oct","kid":"s","k":"c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0"}]}`))
	})
	block := make(chan struct{})
	t.Cleanup(func() { close(block) })
	slow := serve(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-block:
		case <-r.Context().Done():
		}
	})
	for name, u := range map[string]string{"huge": huge, "symmetric": symmetric, "slow": slow, "404": iss.URL + "/nothing"} {
		t.Run(name, func(t *testing.T) {
			_, err := oauth.New(context.Background(), oauth.Config{Issuer: iss.URL, Resource: resource, JWKSURL: u, FetchTimeout: 500 * time.Millisecond})
			if err == nil {
				t.Fatal("accepted")
			}
		})
	}
}

// TestJWKSFile: keys can come from a file, re-read on refresh.
func TestJWKSFile(t *testing.T) {
	iss := oauthtest.New(t)
	p := filepath.Join(t.TempDir(), "jwks.json")
	if err := os.WriteFile(p, iss.JWKS(), 0o644); err != nil {
		t.Fatal(err)
	}
	v, err := oauth.New(context.Background(), oauth.Config{Issuer: iss.URL, Resource: resource, JWKSFile: p, MinRefetch: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if _, err := v.Verify(context.Background(), iss.Mint(t, iss.Good(resource, "kiln:run")), nil); err != nil {
		t.Fatal(err)
	}
	iss.Rotate(t, jose.ES256, false)
	tok := iss.Mint(t, iss.Good(resource, "kiln:run"))
	if _, err := v.Verify(context.Background(), tok, nil); err == nil {
		t.Fatal("a key not in the file was accepted")
	}
	if err := os.WriteFile(p, iss.JWKS(), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(context.Background(), tok, nil); err != nil {
		t.Fatalf("the rewritten file was not read again: %v", err)
	}
}

// TestJWKSSkipsUnknownKeys: a key kiln cannot read does not lock out
// the tokens of the keys it can.
func TestJWKSSkipsUnknownKeys(t *testing.T) {
	iss := oauthtest.New(t)
	var set map[string][]json.RawMessage
	if err := json.Unmarshal(iss.JWKS(), &set); err != nil {
		t.Fatal(err)
	}
	set["keys"] = append([]json.RawMessage{json.RawMessage(`{"kty":"XYZ","kid":"exotic"}`), json.RawMessage(`{"kty":"EC","crv":"P-999","kid":"odd","x":"AA","y":"AA"}`)}, set["keys"]...)
	p := filepath.Join(t.TempDir(), "jwks.json")
	data, _ := json.Marshal(set)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	v, err := oauth.New(context.Background(), oauth.Config{Issuer: iss.URL, Resource: resource, JWKSFile: p})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if _, err := v.Verify(context.Background(), iss.Mint(t, iss.Good(resource, "kiln:run")), nil); err != nil {
		t.Fatal(err)
	}
}

func TestConfigErrors(t *testing.T) {
	iss := oauthtest.New(t)
	for name, cfg := range map[string]oauth.Config{
		"no issuer":        {Resource: resource, JWKSURL: iss.JWKSURL()},
		"no resource":      {Issuer: iss.URL, JWKSURL: iss.JWKSURL()},
		"both keys":        {Issuer: iss.URL, Resource: resource, JWKSURL: iss.JWKSURL(), JWKSFile: "/x"},
		"relative":         {Issuer: iss.URL, Resource: "/mcp", JWKSURL: iss.JWKSURL()},
		"fragment":         {Issuer: iss.URL, Resource: resource + "#x", JWKSURL: iss.JWKSURL()},
		"scope with space": {Issuer: iss.URL, Resource: resource, JWKSURL: iss.JWKSURL(), RunScope: "a b"},
		"empty algorithms": {Issuer: iss.URL, Resource: resource, JWKSURL: iss.JWKSURL(), Algorithms: []string{}},
	} {
		if _, err := oauth.New(context.Background(), cfg); !errors.Is(err, oauth.ErrConfig) {
			t.Errorf("%s: %v, want a configuration error", name, err)
		}
	}
}

// TestDiscovery: without a JWKS URL or file, the keys are found through
// the issuer's metadata, which must name that issuer.
func TestDiscovery(t *testing.T) {
	iss := oauthtest.New(t)
	v, err := oauth.New(context.Background(), oauth.Config{Issuer: iss.URL, Resource: resource})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if _, err := v.Verify(context.Background(), iss.Mint(t, iss.Good(resource, "kiln:run")), nil); err != nil {
		t.Fatal(err)
	}

	// An issuer with a path, whose metadata sits at either well-known
	// place; metadata that names another issuer is refused.
	other := oauthtest.New(t)
	for _, path := range []string{"/.well-known/oauth-authorization-server/realm", "/realm/.well-known/openid-configuration"} {
		t.Run(path, func(t *testing.T) {
			var named string
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != path {
					http.NotFound(w, r)
					return
				}
				json.NewEncoder(w).Encode(map[string]string{"issuer": named, "jwks_uri": other.JWKSURL()})
			}))
			defer ts.Close()
			realm := ts.URL + "/realm"
			named = realm
			v, err := oauth.New(context.Background(), oauth.Config{Issuer: realm, Resource: resource})
			if err != nil {
				t.Fatal(err)
			}
			defer v.Close()
			c := other.Good(resource, "kiln:run")
			c.Issuer = realm
			if _, err := v.Verify(context.Background(), other.Mint(t, c), nil); err != nil {
				t.Fatal(err)
			}
			named = other.URL
			if _, err := oauth.New(context.Background(), oauth.Config{Issuer: realm, Resource: resource}); err == nil {
				t.Fatal("keys were taken from metadata that names another issuer")
			}
		})
	}
}

func TestMetadataURL(t *testing.T) {
	for in, want := range map[string]string{
		"https://kiln.example/mcp":        "https://kiln.example/.well-known/oauth-protected-resource/mcp",
		"https://kiln.example/":           "https://kiln.example/.well-known/oauth-protected-resource",
		"https://kiln.example":            "https://kiln.example/.well-known/oauth-protected-resource",
		"https://kiln.example:8443/a/mcp": "https://kiln.example:8443/.well-known/oauth-protected-resource/a/mcp",
	} {
		got, err := oauth.MetadataURL(in)
		if err != nil || got != want {
			t.Errorf("MetadataURL(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

// TestConcurrentVerify: tokens are verified while the key set is fetched
// again, periodically and for unknown kids (for the race detector: make
// race runs this package).
func TestConcurrentVerify(t *testing.T) {
	iss := oauthtest.New(t)
	v := newVerifier(t, iss, func(c *oauth.Config) { c.Refresh = time.Millisecond; c.MinRefetch = time.Nanosecond })
	tok := iss.Mint(t, iss.Good(resource, "kiln:run"))
	iss.Rotate(t, jose.ES256, true)
	fresh := iss.Mint(t, iss.Good(resource, "kiln:run"))
	done := make(chan error, 8)
	for i := range 8 {
		go func() {
			var err error
			for range 50 {
				tk := tok
				if i%2 == 1 {
					tk = fresh
				}
				if _, e := v.Verify(context.Background(), tk, nil); e != nil {
					err = e
				}
			}
			done <- err
		}()
	}
	for range 8 {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
}

// TestJWKSFileTrusted: whoever can change the key file can mint tokens
// for any subject, so it is checked as the configuration file is: a file
// its group or others can write, or of a user other than root and kiln's,
// is refused, at start and on every re-read.
func TestJWKSFileTrusted(t *testing.T) {
	iss := oauthtest.New(t)
	open := func(mode os.FileMode, uid int) error {
		t.Helper()
		p := filepath.Join(t.TempDir(), "jwks.json")
		if err := os.WriteFile(p, iss.JWKS(), 0o600); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, mode)
		if uid >= 0 {
			if err := os.Chown(p, uid, uid); err != nil {
				t.Fatal(err)
			}
		}
		v, err := oauth.New(context.Background(), oauth.Config{Issuer: iss.URL, Resource: resource, JWKSFile: p})
		if err == nil {
			v.Close()
		}
		return err
	}
	if err := open(0o644, -1); err != nil {
		t.Fatalf("a 0644 key file of kiln's user: %v", err)
	}
	for _, mode := range []os.FileMode{0o666, 0o664, 0o646} {
		if err := open(mode, -1); !errors.Is(err, config.ErrUnsafeFile) || !strings.Contains(err.Error(), "chmod") {
			t.Errorf("a key file of mode %04o: err = %v, want ErrUnsafeFile saying chmod", mode, err)
		}
	}
	if os.Geteuid() != 0 {
		t.Skip("giving a file to another uid needs root")
	}
	if err := open(0o644, 4242); !errors.Is(err, config.ErrUnsafeFile) || !strings.Contains(err.Error(), "uid 4242") {
		t.Errorf("a key file of uid 4242: err = %v, want ErrUnsafeFile naming the uid", err)
	}
}
