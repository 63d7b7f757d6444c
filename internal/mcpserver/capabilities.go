package mcpserver

import (
	"context"
	"fmt"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// undeclared answers the methods of features kiln does not declare with
// "method not found". The SDK serves prompts/list (an empty list) and
// prompts/get whether or not a server has prompts, but a server must not
// handle a feature it does not declare (the 2026-07-28 revision, SEP-2575,
// checked by the MCP conformance suite). kiln has no prompts; if it gets
// some, the SDK declares the capability and this must go (a test fails).
func undeclared(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		switch method {
		case "prompts/list", "prompts/get":
			return nil, &jsonrpc.Error{Code: jsonrpc.CodeMethodNotFound, Message: fmt.Sprintf("method not found: %q (kiln has no prompts)", method)}
		}
		return next(ctx, method, req)
	}
}
