package cli

import (
	"flag"
	"fmt"
	"net"
	"net/http"

	"kiln/internal/mcpserver"
)

// httpLimitFlags are kiln serve's flags for what clients may hold on the
// HTTP listener (see mcpserver.HTTPLimits).
type httpLimitFlags struct {
	lim         mcpserver.HTTPLimits
	inflightMiB int64
}

func registerHTTPLimits(fs *flag.FlagSet) *httpLimitFlags {
	f := &httpLimitFlags{lim: mcpserver.DefaultHTTPLimits()}
	l := &f.lim
	f.inflightMiB = l.MaxInflightBytes >> 20
	fs.DurationVar(&l.HeaderTimeout, "http-header-timeout", l.HeaderTimeout, "a request's headers must arrive within this")
	fs.DurationVar(&l.ReadTimeout, "http-read-timeout", l.ReadTimeout, "a whole request, body included, must arrive within this")
	fs.DurationVar(&l.WriteTimeout, "http-write-timeout", l.WriteTimeout, "a response to an unauthenticated request, and each write of an authenticated one, must complete within this (long calls and SSE streams are not cut)")
	fs.DurationVar(&l.IdleTimeout, "http-idle-timeout", l.IdleTimeout, "close a keep-alive connection idle this long")
	fs.IntVar(&l.MaxConns, "http-max-conns", l.MaxConns, "open connections at most; more wait to be accepted (0: no cap)")
	fs.IntVar(&l.MaxConnsPerAddr, "http-max-conns-per-addr", l.MaxConnsPerAddr, "open connections from one client address (IPv4 address, IPv6 /64) at most; more are closed (0: no cap; use 0 behind a reverse proxy)")
	fs.Int64Var(&f.inflightMiB, "http-max-inflight", f.inflightMiB, "MiB of request bodies held at once across all requests; more wait, then get 503 (0: no bound)")
	fs.DurationVar(&l.SessionIdle, "http-session-idle", l.SessionIdle, "close an MCP transport session (Mcp-Session-Id) after this long without a request (0: never)")
	fs.IntVar(&l.MaxSessions, "http-max-sessions", l.MaxSessions, "MCP transport sessions per principal; past it the least recently used one is closed (0: no cap)")
	return f
}

func (f *httpLimitFlags) limits() mcpserver.HTTPLimits {
	l := f.lim
	l.MaxInflightBytes = f.inflightMiB << 20
	return l
}

// listenHTTP listens on addr and returns kiln's HTTP server for srv and
// the listener, with its connection caps, to serve it on.
func listenHTTP(srv *mcpserver.Server, addr string, opts mcpserver.HTTPOptions) (*http.Server, net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("listening on %s: %w", addr, err)
	}
	lim := mcpserver.DefaultHTTPLimits()
	if opts.Limits != nil {
		lim = *opts.Limits
	}
	return srv.HTTPServer(addr, opts), srv.LimitListener(ln, lim), nil
}
