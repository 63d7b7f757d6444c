package mcpserver

import (
	"net/http"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/oauthex"
)

// OAuth makes /mcp an OAuth 2.1 protected resource (kiln serve --auth
// oidc): bearer tokens are checked by Verify, every request needs all of
// Scopes, and the RFC 9728 metadata is served at
// /.well-known/oauth-protected-resource and under it at any path (the
// form for a resource with a path, e.g. …/oauth-protected-resource/mcp).
type OAuth struct {
	Verify      auth.TokenVerifier
	Metadata    *oauthex.ProtectedResourceMetadata
	MetadataURL string // absolute; named in WWW-Authenticate
	// Scopes are needed for any request to /mcp; a token without one of
	// them gets 403 insufficient_scope, naming them all.
	Scopes []string
	// ClockSkew is forgiven on the expiry Verify reports; give the leeway
	// Verify itself allows, or the SDK refuses what Verify accepted.
	ClockSkew time.Duration
}

// middleware guards next with the SDK's bearer-token check and completes
// its challenges with the RFC 6750 error codes: invalid_token when a
// token was sent and refused, insufficient_scope on 403. Only the
// refusal goes through the rewriting writer; an admitted request reaches
// next with the connection's own.
func (o *OAuth) middleware(next http.Handler) http.Handler {
	check := auth.RequireBearerToken(o.Verify, &auth.RequireBearerTokenOptions{
		ResourceMetadataURL: o.MetadataURL,
		Scopes:              o.Scopes,
		ClockSkew:           o.ClockSkew,
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sent := strings.TrimSpace(r.Header.Get("Authorization")) != ""
		admit := http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { next.ServeHTTP(w, r) })
		check(admit).ServeHTTP(&challengeWriter{ResponseWriter: w, sent: sent}, r)
	})
}

func (o *OAuth) register(mux *http.ServeMux) {
	h := auth.ProtectedResourceMetadataHandler(o.Metadata)
	mux.Handle("/.well-known/oauth-protected-resource", h)
	mux.Handle("/.well-known/oauth-protected-resource/", h)
}

// challengeWriter adds the error code to the SDK's Bearer challenge.
type challengeWriter struct {
	http.ResponseWriter
	sent, wrote bool
}

func (w *challengeWriter) WriteHeader(code int) {
	if !w.wrote {
		w.wrote = true
		errCode := ""
		switch {
		case code == http.StatusForbidden:
			errCode = "insufficient_scope"
		case code == http.StatusUnauthorized && w.sent:
			errCode = "invalid_token"
		}
		if errCode != "" {
			h := w.Header()
			v := h.Get("WWW-Authenticate")
			switch {
			case v == "":
				h.Set("WWW-Authenticate", `Bearer error="`+errCode+`"`)
			case strings.HasPrefix(v, "Bearer "):
				h.Set("WWW-Authenticate", `Bearer error="`+errCode+`", `+strings.TrimPrefix(v, "Bearer "))
			}
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *challengeWriter) Write(p []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(p)
}

func (w *challengeWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
