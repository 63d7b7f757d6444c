package mcpserver

import (
	"context"
	"slices"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/session"
)

// netScoped marks the context of a call whose client may not use the
// network: with Options.NetScope set, a call whose token lacks that scope
// (or that carries no token at all) runs in a box cut off from the
// network, whatever --allow-net says.
func (s *Server) netScoped(ctx context.Context, req *mcp.CallToolRequest) context.Context {
	if s.opts.NetScope == "" {
		return ctx
	}
	if req != nil && req.Extra != nil && req.Extra.TokenInfo != nil && slices.Contains(req.Extra.TokenInfo.Scopes, s.opts.NetScope) {
		return ctx
	}
	return session.Offline(ctx)
}
