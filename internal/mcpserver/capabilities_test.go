package mcpserver_test

import (
	"context"
	"errors"
	"testing"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/session"
)

// TestUndeclaredPromptsNotServed: kiln has no prompts, so it does not
// declare the prompts capability, and prompts/list and prompts/get are
// answered "method not found" rather than with an empty list: a server
// must not handle a feature it does not declare (the 2026-07-28 revision,
// SEP-2575; the conformance suite's sep-2575-server-declares-prompts-in-
// discover). Tools still work.
func TestUndeclaredPromptsNotServed(t *testing.T) {
	mgr := session.NewManager(session.Options{Backend: nil, PoolSize: 0})
	t.Cleanup(mgr.Close)
	cs := dial(t, mcpserver.New(mcpserver.Options{Manager: mgr, Backend: "none"}))
	ctx := context.Background()

	if caps := cs.InitializeResult().Capabilities; caps.Prompts != nil {
		t.Fatalf("kiln declares prompts (%+v): drop the refusal of prompts/* in capabilities.go", caps.Prompts)
	}
	_, err := cs.ListPrompts(ctx, nil)
	var werr *jsonrpc.Error
	if !errors.As(err, &werr) || werr.Code != jsonrpc.CodeMethodNotFound {
		t.Errorf("prompts/list: %v, want method not found (%d)", err, jsonrpc.CodeMethodNotFound)
	}
	_, err = cs.GetPrompt(ctx, &mcp.GetPromptParams{Name: "anything"})
	if !errors.As(err, &werr) || werr.Code != jsonrpc.CodeMethodNotFound {
		t.Errorf("prompts/get: %v, want method not found (%d)", err, jsonrpc.CodeMethodNotFound)
	}
	if res, err := cs.ListTools(ctx, nil); err != nil {
		t.Errorf("tools/list: %v", err)
	} else if len(res.Tools) == 0 {
		t.Error("tools/list: no tools")
	}
}
