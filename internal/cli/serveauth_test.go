package cli

import (
	"context"
	"flag"
	"io"
	"log/slog"
	"strings"
	"testing"

	"kiln/internal/oauth/oauthtest"
)

// TestServeAuthFlags: kiln serve refuses an --auth oidc it cannot honour
// before it starts anything, and says what is missing.
func TestServeAuthFlags(t *testing.T) {
	iss := oauthtest.New(t)
	for _, c := range []struct {
		name string
		env  string
		args []string
		want string
	}{
		{"unknown mode", "", []string{"--auth", "ldap"}, "--auth must be tokens or oidc"},
		{"no resource", "", []string{"--auth", "oidc", "--oidc-issuer", iss.URL}, "--public-url"},
		{"no issuer", "", []string{"--auth", "oidc", "--public-url", "https://kiln.example"}, "issuer is required"},
		{"static token too", strings.Repeat("k", 24), []string{"--auth", "oidc", "--oidc-issuer", iss.URL, "--public-url", "https://kiln.example"}, "KILN_TOKEN"},
		{"issuer down", "", []string{"--auth", "oidc", "--oidc-issuer", "http://127.0.0.1:1", "--public-url", "https://kiln.example"}, "discovering the issuer's keys"},
		{"HMAC", "", []string{"--auth", "oidc", "--oidc-issuer", iss.URL, "--public-url", "https://kiln.example", "--oidc-algs", "HS256"}, "HS256"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("KILN_TOKEN", c.env)
			rc, _, errs := kiln(t, append([]string{"serve", "--addr", "127.0.0.1:0"}, c.args...)...)
			if rc != 1 || !strings.Contains(errs, c.want) {
				t.Errorf("status %d, stderr %q; want status 1 and %q", rc, errs, c.want)
			}
		})
	}
}

// TestServeAuthResource: the resource URI comes from --public-url, and
// the challenge names the metadata at its RFC 9728 place.
func TestServeAuthResource(t *testing.T) {
	iss := oauthtest.New(t)
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	f := registerAuth(fs)
	if err := fs.Parse([]string{"--auth", "oidc", "--oidc-issuer", iss.URL, "--public-url", "https://kiln.example/"}); err != nil {
		t.Fatal(err)
	}
	v, o, err := f.oidc(context.Background(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	if o.Metadata.Resource != "https://kiln.example/mcp" || o.MetadataURL != "https://kiln.example/.well-known/oauth-protected-resource/mcp" {
		t.Errorf("resource %q, metadata URL %q", o.Metadata.Resource, o.MetadataURL)
	}
	if len(o.Scopes) != 1 || o.Scopes[0] != "kiln:run" || v.NetScope() != "kiln:net" {
		t.Errorf("scopes %v, net scope %q", o.Scopes, v.NetScope())
	}
}
