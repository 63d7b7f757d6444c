// Package oauth makes kiln an OAuth 2.1 resource server (the MCP
// authorization spec): it verifies JWT access tokens issued by one
// configured authorization server against that server's published keys,
// and describes kiln to clients in RFC 9728 protected-resource metadata.
//
// A token is accepted only when all of these hold:
//   - it is a compact JWS signed with an algorithm on the allowlist
//     (default RS256, ES256, EdDSA); "none", unsigned tokens and HMAC
//     algorithms never are, whatever the list says, since kiln holds no
//     shared secret and an HMAC over a public key proves nothing;
//   - its key comes from the issuer's JWKS (a URL, a file, or the
//     jwks_uri of the issuer's own metadata), matched by
//     kid, of a type that fits the algorithm, not marked for encryption
//     and not declaring another algorithm;
//   - iss is the configured issuer, exactly; aud names kiln's resource URI
//     (RFC 8707; a trailing slash is forgiven, nothing else); exp is
//     present and not past, nbf and iat not in the future (with Leeway);
//   - sub is present, short and printable.
//
// The principal is "oidc:" + issuer + "#" + sub. Static-token principals
// never hold a ':' (the token file splits on it), so the two never meet.
//
// The key set is fetched at start (kiln refuses to start without one),
// again every Refresh, and again when a token names a kid the set does
// not hold, at most once per MinRefetch: rotation works without a
// restart, while a flood of made-up kids costs at most one fetch per
// MinRefetch. A fetch is bounded in time (FetchTimeout) and size
// (maxJWKSBytes); a failed one keeps the previous keys.
package oauth

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/oauthex"

	"kiln/internal/config"
)

// Defaults of Config.
const (
	DefaultRunScope     = "kiln:run"
	DefaultNetScope     = "kiln:net"
	DefaultRefresh      = time.Hour
	DefaultMinRefetch   = 30 * time.Second
	DefaultFetchTimeout = 10 * time.Second
	DefaultLeeway       = 30 * time.Second
)

// DefaultAlgorithms are the signature algorithms accepted unless
// Config.Algorithms says otherwise.
var DefaultAlgorithms = []string{"RS256", "ES256", "EdDSA"}

// supported are the algorithms Config.Algorithms may name: asymmetric
// signatures only.
var supported = []jose.SignatureAlgorithm{
	jose.RS256, jose.RS384, jose.RS512,
	jose.PS256, jose.PS384, jose.PS512,
	jose.ES256, jose.ES384, jose.ES512,
	jose.EdDSA,
}

const (
	maxJWKSBytes  = 1 << 20
	maxTokenBytes = 16 << 10
	maxSubject    = 256
)

// Config configures a Verifier.
type Config struct {
	Issuer   string // required; the iss of every token, exactly
	Resource string // required; kiln's resource URI, which aud must name

	// JWKSURL or JWKSFile (at most one of them) holds the issuer's
	// public keys. With neither, New finds jwks_uri in the issuer's
	// metadata (RFC 8414, then OpenID Connect Discovery).
	JWKSURL  string
	JWKSFile string

	Algorithms []string // nil: DefaultAlgorithms

	RunScope string // "": DefaultRunScope; needed for any MCP request
	NetScope string // "": DefaultNetScope; needed for boxes with egress

	Refresh      time.Duration // 0: DefaultRefresh; <0: never
	MinRefetch   time.Duration // 0: DefaultMinRefetch
	FetchTimeout time.Duration // 0: DefaultFetchTimeout
	Leeway       time.Duration // 0: DefaultLeeway; <0: none

	// AuthorizationServers are listed in the metadata (nil: Issuer).
	AuthorizationServers []string

	HTTPClient *http.Client // nil: a client with FetchTimeout
	Logger     *slog.Logger
}

// Errors of New.
var (
	ErrConfig = errors.New("oauth configuration")
)

// Verifier checks access tokens. Its Verify is an auth.TokenVerifier.
type Verifier struct {
	cfg    Config
	algs   []jose.SignatureAlgorithm
	client *http.Client
	log    *slog.Logger

	mu        sync.RWMutex
	keys      jose.JSONWebKeySet
	fetchMu   sync.Mutex // one fetch at a time
	lastFetch time.Time  // guarded by fetchMu

	stop chan struct{}
	done chan struct{}
	once sync.Once
}

// New checks cfg, loads the key set and starts refreshing it. Close stops
// the refresh.
func New(ctx context.Context, cfg Config) (*Verifier, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	v := &Verifier{cfg: cfg, client: cfg.HTTPClient, log: cfg.Logger, stop: make(chan struct{}), done: make(chan struct{})}
	for _, a := range cfg.Algorithms {
		alg := jose.SignatureAlgorithm(a)
		if !slices.Contains(supported, alg) {
			return nil, fmt.Errorf("%w: signature algorithm %q is not accepted (use some of %v; HMAC and none never are)", ErrConfig, a, supported)
		}
		v.algs = append(v.algs, alg)
	}
	if v.client == nil {
		v.client = &http.Client{Timeout: cfg.FetchTimeout}
	}
	if cfg.JWKSURL == "" && cfg.JWKSFile == "" {
		u, err := v.discoverJWKS(ctx)
		if err != nil {
			return nil, err
		}
		v.cfg.JWKSURL = u
		v.log.Info("found the issuer's keys in its metadata", "jwks_uri", u)
	}
	v.fetchMu.Lock()
	err := v.fetch(ctx)
	v.fetchMu.Unlock()
	if err != nil {
		return nil, err
	}
	if cfg.Refresh > 0 {
		go v.refreshLoop()
	} else {
		close(v.done)
	}
	return v, nil
}

func (c *Config) fill() error {
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if err := checkURL(c.Issuer, "issuer"); err != nil {
		return err
	}
	if err := checkURL(c.Resource, "resource URI"); err != nil {
		return err
	}
	switch {
	case c.JWKSURL != "" && c.JWKSFile != "":
		return fmt.Errorf("%w: give the issuer's keys as a JWKS URL or a JWKS file, not both", ErrConfig)
	case c.JWKSURL != "":
		if err := checkURL(c.JWKSURL, "JWKS URL"); err != nil {
			return err
		}
	}
	if c.Algorithms == nil {
		c.Algorithms = DefaultAlgorithms
	}
	if len(c.Algorithms) == 0 {
		return fmt.Errorf("%w: no signature algorithm allowed", ErrConfig)
	}
	if c.RunScope == "" {
		c.RunScope = DefaultRunScope
	}
	if c.NetScope == "" {
		c.NetScope = DefaultNetScope
	}
	for _, s := range []string{c.RunScope, c.NetScope} {
		if strings.ContainsFunc(s, func(r rune) bool { return r <= ' ' || r == '"' || r == '\\' || r > '~' }) {
			return fmt.Errorf("%w: scope %q has a character scopes may not hold", ErrConfig, s)
		}
	}
	if c.Refresh == 0 {
		c.Refresh = DefaultRefresh
	}
	if c.MinRefetch == 0 {
		c.MinRefetch = DefaultMinRefetch
	}
	if c.FetchTimeout <= 0 {
		c.FetchTimeout = DefaultFetchTimeout
	}
	switch {
	case c.Leeway == 0:
		c.Leeway = DefaultLeeway
	case c.Leeway < 0:
		c.Leeway = 0
	}
	if c.AuthorizationServers == nil {
		c.AuthorizationServers = []string{c.Issuer}
	}
	return nil
}

// checkURL accepts an absolute http(s) URL without a fragment.
func checkURL(s, what string) error {
	if s == "" {
		return fmt.Errorf("%w: the %s is required", ErrConfig, what)
	}
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("%w: the %s %q: %v", ErrConfig, what, s, err)
	}
	if (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || u.Fragment != "" {
		return fmt.Errorf("%w: the %s %q must be an absolute http(s) URL without a fragment", ErrConfig, what, s)
	}
	return nil
}

// Close stops refreshing the key set.
func (v *Verifier) Close() error {
	v.once.Do(func() { close(v.stop) })
	<-v.done
	return nil
}

// RunScope and NetScope are the scope names in force.
func (v *Verifier) RunScope() string { return v.cfg.RunScope }
func (v *Verifier) NetScope() string { return v.cfg.NetScope }

// Leeway is the clock skew forgiven on exp, nbf and iat.
func (v *Verifier) Leeway() time.Duration { return v.cfg.Leeway }

// Resource is kiln's resource URI.
func (v *Verifier) Resource() string { return v.cfg.Resource }

func (v *Verifier) refreshLoop() {
	defer close(v.done)
	t := time.NewTicker(v.cfg.Refresh)
	defer t.Stop()
	for {
		select {
		case <-v.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), v.cfg.FetchTimeout)
		v.fetchMu.Lock()
		if err := v.fetch(ctx); err != nil {
			v.log.Warn("refreshing the issuer's keys; keeping the previous ones", "err", err)
		}
		v.fetchMu.Unlock()
		cancel()
	}
}

// fetch loads the key set and replaces the one in use. The caller holds
// fetchMu.
func (v *Verifier) fetch(ctx context.Context) error {
	v.lastFetch = time.Now()
	data, err := v.read(ctx)
	if err != nil {
		return fmt.Errorf("loading the issuer's keys: %w", err)
	}
	set, err := parseJWKS(data)
	if err != nil {
		return fmt.Errorf("loading the issuer's keys from %s: %w", v.source(), err)
	}
	v.mu.Lock()
	v.keys = set
	v.mu.Unlock()
	v.log.Debug("loaded the issuer's keys", "from", v.source(), "keys", len(set.Keys))
	return nil
}

func (v *Verifier) source() string {
	if v.cfg.JWKSFile != "" {
		return v.cfg.JWKSFile
	}
	return v.cfg.JWKSURL
}

func (v *Verifier) read(ctx context.Context) ([]byte, error) {
	if v.cfg.JWKSFile != "" {
		// Whoever can change this file can mint tokens for anyone.
		f, err := config.OpenTrusted("key set file", v.cfg.JWKSFile, false)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return readCapped(f)
	}
	ctx, cancel := context.WithTimeout(ctx, v.cfg.FetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, v.cfg.JWKSURL, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json, application/jwk-set+json")
	resp, err := v.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", v.cfg.JWKSURL, resp.Status)
	}
	return readCapped(resp.Body)
}

func readCapped(r io.Reader) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxJWKSBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxJWKSBytes {
		return nil, fmt.Errorf("key set larger than %d bytes", maxJWKSBytes)
	}
	return data, nil
}

// parseJWKS keeps the public signing keys of a JWKS document. Keys kiln
// cannot read (a type or curve go-jose does not know) are skipped, so
// one exotic key of the issuer does not lock every client out; skipping
// a key can only refuse tokens. Symmetric keys are refused outright: a
// JWKS that publishes one is misconfigured.
func parseJWKS(data []byte) (jose.JSONWebKeySet, error) {
	var raw struct {
		Keys []json.RawMessage `json:"keys"`
	}
	var out jose.JSONWebKeySet
	if err := json.Unmarshal(data, &raw); err != nil {
		return out, err
	}
	for _, r := range raw.Keys {
		var k jose.JSONWebKey
		if err := k.UnmarshalJSON(r); err != nil {
			continue
		}
		if _, sym := k.Key.([]byte); sym {
			return out, fmt.Errorf("key %q is a symmetric key; a key set must hold public keys only", k.KeyID)
		}
		if k.Use != "" && k.Use != "sig" {
			continue
		}
		pub := k.Public()
		if !pub.Valid() {
			continue
		}
		out.Keys = append(out.Keys, pub)
	}
	if len(out.Keys) == 0 {
		return out, errors.New("no public signing key in the key set")
	}
	return out, nil
}

// claims are the claims kiln reads.
type claims struct {
	jwt.Claims
	Scope string   `json:"scope,omitempty"` // RFC 9068, space-separated
	Scp   []string `json:"scp,omitempty"`   // the array some issuers use
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{auth.ErrInvalidToken}, args...)...)
}

// Verify checks token and names its principal and scopes. Every error
// wraps auth.ErrInvalidToken, so the SDK's middleware answers 401; the
// reason goes to the client and to the debug log.
func (v *Verifier) Verify(ctx context.Context, token string, r *http.Request) (*auth.TokenInfo, error) {
	ti, err := v.verify(ctx, token)
	if err != nil {
		remote := ""
		if r != nil {
			remote = r.RemoteAddr
		}
		v.log.Debug("refused an access token", "remote", remote, "reason", err)
	}
	return ti, err
}

func (v *Verifier) verify(ctx context.Context, token string) (*auth.TokenInfo, error) {
	if len(token) > maxTokenBytes {
		return nil, invalid("token longer than %d bytes", maxTokenBytes)
	}
	tok, err := jwt.ParseSigned(token, v.algs)
	if err != nil {
		return nil, invalid("not a JWT signed with an accepted algorithm (%s)", strings.Join(v.cfg.Algorithms, ", "))
	}
	if len(tok.Headers) != 1 {
		return nil, invalid("expected one signature")
	}
	h := tok.Headers[0]
	var c claims
	if err := v.verifySig(ctx, tok, h, &c); err != nil {
		return nil, err
	}
	if err := c.ValidateWithLeeway(jwt.Expected{Issuer: v.cfg.Issuer}, v.cfg.Leeway); err != nil {
		return nil, invalid("%v", err)
	}
	if c.Expiry == nil {
		return nil, invalid("token has no expiry (exp)")
	}
	if !oauthex.MatchesResource(c.Audience, v.cfg.Resource) {
		return nil, invalid("token is not for this resource (aud must name %s)", v.cfg.Resource)
	}
	if c.Subject == "" || len(c.Subject) > maxSubject || strings.ContainsFunc(c.Subject, func(r rune) bool { return !unicode.IsPrint(r) }) {
		return nil, invalid("token subject (sub) missing, longer than %d bytes or not printable", maxSubject)
	}
	scopes := strings.Fields(c.Scope)
	for _, s := range c.Scp {
		if !slices.Contains(scopes, s) {
			scopes = append(scopes, s)
		}
	}
	return &auth.TokenInfo{
		UserID:     "oidc:" + v.cfg.Issuer + "#" + c.Subject,
		Scopes:     scopes,
		Expiration: c.Expiry.Time(),
		Extra:      map[string]any{"iss": c.Issuer, "sub": c.Subject},
	}, nil
}

// verifySig checks the signature with the key the header names, fetching
// the key set again (rate-limited) when it does not hold that key.
func (v *Verifier) verifySig(ctx context.Context, tok *jwt.JSONWebToken, h jose.Header, dest *claims) error {
	alg := jose.SignatureAlgorithm(h.Algorithm)
	keys := v.candidates(h.KeyID, alg)
	if len(keys) == 0 {
		v.refetch(ctx)
		keys = v.candidates(h.KeyID, alg)
	}
	if len(keys) == 0 {
		return invalid("no key of the issuer matches the token's key id and algorithm (%s)", alg)
	}
	for _, k := range keys {
		if err := tok.Claims(k.Key, dest); err == nil {
			return nil
		}
	}
	return invalid("signature does not verify")
}

// candidates are the keys of the set that may have signed a token with
// this kid and alg.
func (v *Verifier) candidates(kid string, alg jose.SignatureAlgorithm) []jose.JSONWebKey {
	v.mu.RLock()
	defer v.mu.RUnlock()
	var out []jose.JSONWebKey
	for _, k := range v.keys.Keys {
		if kid != "" && k.KeyID != kid {
			continue
		}
		if k.Algorithm != "" && k.Algorithm != string(alg) {
			continue
		}
		out = append(out, k)
	}
	return out
}

// refetch fetches the key set again unless it was fetched less than
// MinRefetch ago. Callers arriving during a fetch wait for it.
func (v *Verifier) refetch(ctx context.Context) {
	v.fetchMu.Lock()
	defer v.fetchMu.Unlock()
	if time.Since(v.lastFetch) < v.cfg.MinRefetch {
		return
	}
	// The request may be cancelled; the fetch serves later ones too.
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), v.cfg.FetchTimeout)
	defer cancel()
	if err := v.fetch(fctx); err != nil {
		v.log.Warn("fetching the issuer's keys for an unknown key id; keeping the previous ones", "err", err)
	}
}

// Metadata is kiln's RFC 9728 protected-resource metadata.
func (v *Verifier) Metadata() *oauthex.ProtectedResourceMetadata {
	return &oauthex.ProtectedResourceMetadata{
		Resource:               v.cfg.Resource,
		AuthorizationServers:   v.cfg.AuthorizationServers,
		ScopesSupported:        []string{v.cfg.RunScope, v.cfg.NetScope},
		BearerMethodsSupported: []string{"header"},
		ResourceName:           "kiln sandbox",
	}
}

// MetadataURL is where RFC 9728 §3.1 puts the metadata of resource: the
// well-known path inserted between its host and its path.
func MetadataURL(resource string) (string, error) {
	u, err := url.Parse(resource)
	if err != nil {
		return "", err
	}
	p := strings.TrimSuffix(u.Path, "/")
	u.Path = "/.well-known/oauth-protected-resource" + p
	u.RawPath = ""
	u.RawQuery = ""
	u.Fragment = ""
	return u.String(), nil
}
