package mcpserver

import (
	"context"
	"slices"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/session"
)

// netScoped marks the context of every request whose client may not use
// the network, whatever the method (a tool call, resources/read, which
// wakes a hibernated session, and any method added later): with
// Options.NetScope set, a request whose token lacks that scope (or that
// carries no token at all) gets boxes cut off from the network, whatever
// --allow-net says. The session layer applies the mark where a box is
// acquired (session/offline.go).
func (s *Server) netScoped(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		if s.opts.NetScope == "" {
			return next(ctx, method, req)
		}
		if extra := req.GetExtra(); extra != nil && extra.TokenInfo != nil && slices.Contains(extra.TokenInfo.Scopes, s.opts.NetScope) {
			return next(ctx, method, req)
		}
		return next(session.Offline(ctx), method, req)
	}
}
