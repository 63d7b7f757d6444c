package mcpserver

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// Token is one accepted bearer token and the principal it names.
type Token struct {
	Principal string
	Secret    string
}

// LoadTokens reads tokens from the KILN_TOKEN value (one token) and from a
// file of lines "principal:token" or "token" ('#' comments).
func LoadTokens(envValue, file string) ([]Token, error) {
	var toks []Token
	add := func(line string) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			return
		}
		name, secret, ok := strings.Cut(line, ":")
		if !ok {
			secret = line
			sum := sha256.Sum256([]byte(secret))
			name = "token-" + hex.EncodeToString(sum[:4])
		}
		toks = append(toks, Token{Principal: strings.TrimSpace(name), Secret: strings.TrimSpace(secret)})
	}
	if envValue != "" {
		add(envValue)
	}
	if file != "" {
		f, err := os.Open(file)
		if err != nil {
			return nil, fmt.Errorf("reading token file: %w", err)
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			add(sc.Text())
		}
		if err := sc.Err(); err != nil {
			return nil, fmt.Errorf("reading token file: %w", err)
		}
	}
	for _, t := range toks {
		if len(t.Secret) < 16 {
			return nil, fmt.Errorf("token for %q is shorter than 16 characters", t.Principal)
		}
	}
	return toks, nil
}

// HTTPOptions configure the streamable HTTP endpoint.
type HTTPOptions struct {
	Tokens []Token // empty: no authentication (loopback only; checked by ListenAndServe)
}

// Handler serves MCP at /mcp for both protocol generations: sessionful
// clients (initialize, Mcp-Session-Id) go to a stateful handler; requests
// of the 2026-07-28 stateless revision (MCP-Protocol-Version header at or
// after it, no session header) go to a stateless one. The tools are the
// same; every result names its session, so nothing depends on a transport
// session existing.
func (s *Server) Handler(opts HTTPOptions) http.Handler {
	get := func(*http.Request) *mcp.Server { return s.mcp }
	stateful := mcp.NewStreamableHTTPHandler(get, &mcp.StreamableHTTPOptions{Logger: s.log, MaxRequestBodyBytes: 16 << 20})
	stateless := mcp.NewStreamableHTTPHandler(get, &mcp.StreamableHTTPOptions{Stateless: true, JSONResponse: true, Logger: s.log, MaxRequestBodyBytes: 16 << 20})
	var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Mcp-Session-Id") == "" && r.Header.Get("Mcp-Protocol-Version") >= "2026-07-28" {
			stateless.ServeHTTP(w, r)
			return
		}
		stateful.ServeHTTP(w, r)
	})
	if len(opts.Tokens) > 0 {
		h = auth.RequireBearerToken(verifier(opts.Tokens), nil)(h)
	}
	mux := http.NewServeMux()
	mux.Handle("/mcp", h)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	return mux
}

func verifier(toks []Token) auth.TokenVerifier {
	return func(ctx context.Context, token string, r *http.Request) (*auth.TokenInfo, error) {
		for _, t := range toks {
			if subtle.ConstantTimeCompare([]byte(token), []byte(t.Secret)) == 1 {
				return &auth.TokenInfo{UserID: t.Principal, Expiration: time.Now().Add(24 * time.Hour)}, nil
			}
		}
		return nil, auth.ErrInvalidToken
	}
}

// ErrNoToken refuses to expose kiln beyond loopback without a token.
var ErrNoToken = errors.New("refusing to listen on a non-loopback address without a token (set KILN_TOKEN or --token-file)")

// CheckListen refuses a non-loopback address when there are no tokens.
func CheckListen(addr string, toks []Token) error {
	if len(toks) > 0 {
		return nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("parsing address %q: %w", addr, err)
	}
	if host == "localhost" {
		return nil
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return ErrNoToken
	}
	return nil
}
