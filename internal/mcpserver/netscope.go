package mcpserver

import (
	"context"
	"slices"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/session"
)

// PrincipalNetwork is the network the operator set for one principal.
type PrincipalNetwork struct {
	Hosts    []string // allowlist entries, within the server's; none: no network
	Describe string   // the sentence the principal's tool descriptions give ("": no network)
}

// netScoped marks the context of every request whose client may not use
// the network, or may use only its own allowlist, whatever the method (a
// tool call, resources/read, which wakes a hibernated session, and any
// method added later):
//   - with Options.NetScope set, a request whose token lacks that scope
//     (or that carries no token at all) gets boxes cut off from the
//     network, whatever --allow-net says;
//   - with Options.NetworkFor set, a request of a principal the operator
//     gave an allowlist gets boxes narrowed to it, and its tools/list
//     says so in run_python's and run_shell's descriptions.
//
// The session layer applies the mark where a box is acquired
// (session/offline.go).
func (s *Server) netScoped(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		extra := req.GetExtra()
		if s.opts.NetScope != "" && (extra == nil || extra.TokenInfo == nil || !slices.Contains(extra.TokenInfo.Scopes, s.opts.NetScope)) {
			return next(session.Offline(ctx), method, req)
		}
		if s.opts.NetworkFor == nil {
			return next(ctx, method, req)
		}
		pn, ok := s.opts.NetworkFor(principalOf(extra))
		if !ok {
			return next(ctx, method, req)
		}
		res, err := next(session.WithNetwork(ctx, pn.Hosts), method, req)
		if list, isList := res.(*mcp.ListToolsResult); isList && err == nil {
			res = s.describedFor(list, pn.Describe)
		}
		return res, err
	}
}

// describedFor is list with run_python's and run_shell's descriptions
// written for a principal whose network network describes. The server's
// tools are shared, so the list and the tools it changes are copies.
func (s *Server) describedFor(list *mcp.ListToolsResult, network string) *mcp.ListToolsResult {
	out := *list
	out.Tools = slices.Clone(list.Tools)
	for i, tool := range out.Tools {
		var desc string
		switch tool.Name {
		case "run_python":
			desc = s.describeRunPython(network)
		case "run_shell":
			desc = s.describeRunShell(network)
		default:
			continue
		}
		c := *tool
		c.Description = desc
		if c.Annotations != nil {
			a := *c.Annotations
			a.OpenWorldHint = boolPtr(network != "")
			c.Annotations = &a
		}
		out.Tools[i] = &c
	}
	return &out
}
