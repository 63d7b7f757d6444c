package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"kiln/internal/mcpserver"
	"kiln/internal/oauth"
)

// authFlags are kiln serve's flags for how clients authenticate: static
// bearer tokens (the simple mode) or OAuth 2.1 access tokens of an
// authorization server (--auth oidc).
type authFlags struct {
	mode        string
	issuer      string
	jwksURL     string
	jwksFile    string
	algs        string
	publicURL   string
	resourceURI string
	runScope    string
	netScope    string
	refresh     time.Duration
	leeway      time.Duration
}

func registerAuth(fs *flag.FlagSet) *authFlags {
	f := &authFlags{}
	fs.StringVar(&f.mode, "auth", "tokens", "how clients authenticate: tokens (KILN_TOKEN, --token-file) or oidc (JWT access tokens of --oidc-issuer)")
	fs.StringVar(&f.issuer, "oidc-issuer", "", "oidc: the authorization server's issuer identifier; every token's iss must equal it")
	fs.StringVar(&f.jwksURL, "oidc-jwks-url", "", "oidc: URL of the issuer's JSON Web Key Set (default: the jwks_uri of the issuer's metadata)")
	fs.StringVar(&f.jwksFile, "oidc-jwks-file", "", "oidc: file holding the issuer's JSON Web Key Set, instead of --oidc-jwks-url")
	fs.StringVar(&f.algs, "oidc-algs", strings.Join(oauth.DefaultAlgorithms, ","), "oidc: signature algorithms accepted, comma-separated (RS*, PS*, ES*, EdDSA; never HS* or none)")
	fs.StringVar(&f.publicURL, "public-url", "", "oidc: the URL clients reach kiln at (e.g. https://kiln.example.com); the resource URI is it plus /mcp")
	fs.StringVar(&f.resourceURI, "resource-uri", "", "oidc: kiln's resource URI, which every token's aud must name (default: --public-url + /mcp)")
	fs.StringVar(&f.runScope, "oidc-scope-run", oauth.DefaultRunScope, "oidc: scope a token needs to use kiln at all (run code, file tools)")
	fs.StringVar(&f.netScope, "oidc-scope-net", oauth.DefaultNetScope, "oidc: scope a token needs for its calls to reach the --allow-net hosts; without it its boxes have no network")
	fs.DurationVar(&f.refresh, "oidc-jwks-refresh", oauth.DefaultRefresh, "oidc: fetch the issuer's keys again this often (also on an unknown key id, at most every 30s)")
	fs.DurationVar(&f.leeway, "oidc-leeway", oauth.DefaultLeeway, "oidc: clock skew forgiven on exp, nbf and iat")
	return f
}

// resource is kiln's resource URI.
func (f *authFlags) resource() (string, error) {
	switch {
	case f.resourceURI != "":
		return f.resourceURI, nil
	case f.publicURL != "":
		return strings.TrimSuffix(f.publicURL, "/") + "/mcp", nil
	}
	return "", errors.New("--auth oidc needs --public-url (the URL clients reach kiln at) or --resource-uri")
}

// oidc starts verifying tokens of the configured issuer; nil in tokens
// mode. Close the verifier when done.
func (f *authFlags) oidc(ctx context.Context, log *slog.Logger) (*oauth.Verifier, *mcpserver.OAuth, error) {
	switch f.mode {
	case "tokens":
		return nil, nil, nil
	case "oidc":
	default:
		return nil, nil, fmt.Errorf("--auth must be tokens or oidc, not %q", f.mode)
	}
	res, err := f.resource()
	if err != nil {
		return nil, nil, err
	}
	leeway := f.leeway
	if leeway == 0 {
		leeway = -1 // none, not the default
	}
	refresh := f.refresh
	if refresh <= 0 {
		refresh = -1 // never
	}
	v, err := oauth.New(ctx, oauth.Config{
		Issuer:     f.issuer,
		Resource:   res,
		JWKSURL:    f.jwksURL,
		JWKSFile:   f.jwksFile,
		Algorithms: splitList(f.algs),
		RunScope:   f.runScope,
		NetScope:   f.netScope,
		Refresh:    refresh,
		Leeway:     leeway,
		Logger:     log,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("--auth oidc: %w", err)
	}
	meta, err := oauth.MetadataURL(res)
	if err != nil {
		v.Close()
		return nil, nil, err
	}
	return v, &mcpserver.OAuth{Verify: v.Verify, Metadata: v.Metadata(), MetadataURL: meta, Scopes: []string{v.RunScope()}, ClockSkew: v.Leeway()}, nil
}
