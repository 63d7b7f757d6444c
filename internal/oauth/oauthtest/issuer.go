// Package oauthtest is a local authorization server for tests: it serves
// a JWKS over HTTP, mints access tokens and rotates its signing keys.
package oauthtest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
)

// Issuer is a test authorization server. Its URL is the issuer
// identifier; the key set is at URL + "/jwks", named in its RFC 8414
// metadata.
type Issuer struct {
	URL string

	mu      sync.Mutex
	keys    []jose.JSONWebKey // private; the first signs
	n       int
	fetches atomic.Int64
}

// New starts an issuer with one RSA key; it stops when the test ends.
func New(t testing.TB) *Issuer {
	t.Helper()
	iss := &Issuer{}
	iss.keys = []jose.JSONWebKey{iss.newKey(t, jose.RS256)}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/jwks":
			iss.fetches.Add(1)
			w.Write(iss.JWKS())
		case "/.well-known/oauth-authorization-server":
			json.NewEncoder(w).Encode(map[string]any{"issuer": iss.URL, "jwks_uri": iss.JWKSURL(), "code_challenge_methods_supported": []string{"S256"}})
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(ts.Close)
	iss.URL = ts.URL
	return iss
}

// JWKSURL is where the issuer serves its public keys.
func (iss *Issuer) JWKSURL() string { return iss.URL + "/jwks" }

// Fetches counts the requests for the key set.
func (iss *Issuer) Fetches() int64 { return iss.fetches.Load() }

func (iss *Issuer) newKey(t testing.TB, alg jose.SignatureAlgorithm) jose.JSONWebKey {
	t.Helper()
	iss.n++
	var key any
	var err error
	switch alg {
	case jose.RS256:
		key, err = rsa.GenerateKey(rand.Reader, 2048)
	case jose.ES256:
		key, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	default:
		t.Fatalf("oauthtest: no key for %s", alg)
	}
	if err != nil {
		t.Fatal(err)
	}
	return jose.JSONWebKey{Key: key, KeyID: fmt.Sprintf("key-%d", iss.n), Algorithm: string(alg), Use: "sig"}
}

// JWKS is the public key set as served.
func (iss *Issuer) JWKS() []byte {
	iss.mu.Lock()
	defer iss.mu.Unlock()
	var set jose.JSONWebKeySet
	for _, k := range iss.keys {
		set.Keys = append(set.Keys, k.Public())
	}
	b, _ := json.Marshal(set)
	return b
}

// Key is the current signing key (private).
func (iss *Issuer) Key() jose.JSONWebKey {
	iss.mu.Lock()
	defer iss.mu.Unlock()
	return iss.keys[0]
}

// Rotate adds a new signing key of alg in front; with keepOld false the
// previous keys leave the set.
func (iss *Issuer) Rotate(t testing.TB, alg jose.SignatureAlgorithm, keepOld bool) {
	iss.mu.Lock()
	defer iss.mu.Unlock()
	k := iss.newKey(t, alg)
	if keepOld {
		iss.keys = append([]jose.JSONWebKey{k}, iss.keys...)
	} else {
		iss.keys = []jose.JSONWebKey{k}
	}
}

// Claims are the claims of a token; the zero value of a field is left
// out of the token.
type Claims struct {
	Issuer    string
	Subject   string
	Audience  []string
	Scope     string
	Expiry    time.Time
	NotBefore time.Time
	IssuedAt  time.Time
}

// Good are claims kiln should accept for resource, with scope.
func (iss *Issuer) Good(resource, scope string) Claims {
	now := time.Now()
	return Claims{Issuer: iss.URL, Subject: "alice", Audience: []string{resource}, Scope: scope,
		Expiry: now.Add(5 * time.Minute), IssuedAt: now.Add(-time.Second), NotBefore: now.Add(-time.Second)}
}

// Mint signs c with the current key.
func (iss *Issuer) Mint(t testing.TB, c Claims) string {
	t.Helper()
	return MintWith(t, iss.Key(), c)
}

// MintWith signs c with key (its KeyID and Algorithm go in the header).
func MintWith(t testing.TB, key jose.JSONWebKey, c Claims) string {
	t.Helper()
	opts := (&jose.SignerOptions{}).WithType("at+jwt")
	sig, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.SignatureAlgorithm(key.Algorithm), Key: key}, opts)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := jwt.Signed(sig).Claims(c.jwt()).Serialize()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// Payload is c as the JSON payload of a token, for tests that build
// tokens by hand.
func (c Claims) Payload() []byte {
	b, _ := json.Marshal(c.jwt())
	return b
}

func (c Claims) jwt() map[string]any {
	m := map[string]any{}
	if c.Issuer != "" {
		m["iss"] = c.Issuer
	}
	if c.Subject != "" {
		m["sub"] = c.Subject
	}
	if len(c.Audience) > 0 {
		m["aud"] = c.Audience
	}
	if c.Scope != "" {
		m["scope"] = c.Scope
	}
	for k, v := range map[string]time.Time{"exp": c.Expiry, "nbf": c.NotBefore, "iat": c.IssuedAt} {
		if !v.IsZero() {
			m[k] = v.Unix()
		}
	}
	return m
}

// Forgeries are tokens a verifier must refuse, each carrying claims c
// that would be accepted if the token were signed properly.
func (iss *Issuer) Forgeries(t testing.TB, c Claims) map[string]string {
	t.Helper()
	key := iss.Key()
	pub := key.Public()
	der, err := x509.MarshalPKIXPublicKey(pub.Key)
	if err != nil {
		t.Fatal(err)
	}
	b64 := base64.RawURLEncoding.EncodeToString
	compact := func(header map[string]any, sig []byte, hmacKey []byte) string {
		h, _ := json.Marshal(header)
		input := b64(h) + "." + b64(c.Payload())
		if hmacKey != nil {
			m := hmac.New(sha256.New, hmacKey)
			m.Write([]byte(input))
			sig = m.Sum(nil)
		}
		return input + "." + b64(sig)
	}
	good := iss.Mint(t, c)
	parts := strings.Split(good, ".")
	sig, _ := base64.RawURLEncoding.DecodeString(parts[2])
	sig[len(sig)/2] ^= 1
	later := c
	later.NotBefore = time.Now().Add(time.Hour)
	expired := c
	expired.Expiry = time.Now().Add(-time.Hour)
	return map[string]string{
		"unsigned":                     compact(map[string]any{"alg": key.Algorithm, "kid": key.KeyID}, nil, nil),
		"alg none":                     compact(map[string]any{"alg": "none", "kid": key.KeyID}, nil, nil),
		"HS256 with the public key":    compact(map[string]any{"alg": "HS256", "kid": key.KeyID}, nil, der),
		"unknown kid":                  compact(map[string]any{"alg": key.Algorithm, "kid": "no-such-key"}, make([]byte, 256), nil),
		"tampered signature":           parts[0] + "." + parts[1] + "." + b64(sig),
		"payload swapped":              parts[0] + "." + b64([]byte(`{"sub":"mallory"}`)) + "." + parts[2],
		"not yet valid":                iss.Mint(t, later),
		"expired":                      iss.Mint(t, expired),
		"signed by another issuer key": MintWith(t, iss.newKeyLocked(t), c),
	}
}

// newKeyLocked makes a key that is not in the issuer's set.
func (iss *Issuer) newKeyLocked(t testing.TB) jose.JSONWebKey {
	iss.mu.Lock()
	defer iss.mu.Unlock()
	return iss.newKey(t, jose.RS256)
}
