package oauth

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// discoveryURLs are where an issuer publishes its metadata: RFC 8414
// (the well-known path inserted before the issuer's path), then OpenID
// Connect Discovery (appended to it).
func discoveryURLs(issuer string) ([]string, error) {
	u, err := url.Parse(issuer)
	if err != nil {
		return nil, err
	}
	p := strings.TrimSuffix(u.Path, "/")
	rfc := *u
	rfc.Path, rfc.RawPath = "/.well-known/oauth-authorization-server"+p, ""
	oidc := *u
	oidc.Path, oidc.RawPath = p+"/.well-known/openid-configuration", ""
	return []string{rfc.String(), oidc.String()}, nil
}

// discoverJWKS finds the issuer's jwks_uri in its metadata. The
// document must name the issuer exactly (RFC 8414 §3.3), so a metadata
// URL cannot point kiln at another issuer's keys.
func (v *Verifier) discoverJWKS(ctx context.Context) (string, error) {
	urls, err := discoveryURLs(v.cfg.Issuer)
	if err != nil {
		return "", err
	}
	var errs []error
	for _, u := range urls {
		jwks, err := v.jwksFrom(ctx, u)
		if err == nil {
			return jwks, nil
		}
		errs = append(errs, err)
	}
	return "", fmt.Errorf("discovering the issuer's keys (give --oidc-jwks-url to skip this): %w", errors.Join(errs...))
}

func (v *Verifier) jwksFrom(ctx context.Context, metaURL string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, v.cfg.FetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, metaURL, nil)
	if err != nil {
		return "", err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := v.client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", metaURL, resp.Status)
	}
	data, err := readCapped(resp.Body)
	if err != nil {
		return "", fmt.Errorf("GET %s: %w", metaURL, err)
	}
	var meta struct {
		Issuer  string `json:"issuer"`
		JWKSURI string `json:"jwks_uri"`
	}
	if err := json.Unmarshal(data, &meta); err != nil {
		return "", fmt.Errorf("GET %s: %w", metaURL, err)
	}
	if meta.Issuer != v.cfg.Issuer {
		return "", fmt.Errorf("GET %s: the metadata is of issuer %q, not %q", metaURL, meta.Issuer, v.cfg.Issuer)
	}
	if err := checkURL(meta.JWKSURI, "jwks_uri of "+metaURL); err != nil {
		return "", err
	}
	return meta.JWKSURI, nil
}
