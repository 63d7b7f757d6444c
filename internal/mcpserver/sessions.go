package mcpserver

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/session"
)

// ListSessionsArgs takes nothing: a client sees only its own sessions.
type ListSessionsArgs struct{}

func (s *Server) addSessionTools() {
	desc := "List your sessions: live ones (with a sandbox now), and new ones (none yet)."
	if h := s.mgr.Options().Hibernate; h.Dir != "" {
		desc = fmt.Sprintf("List your sessions: live ones (with a sandbox now), new ones (none yet) and hibernated ones. A session unused for %s is hibernated: saved to disk and its sandbox destroyed; the next call naming it resumes it as it was (variables and workspace files; not running processes), also after kiln restarts, and its result says it resumed. Hibernated sessions are kept %s.",
			h.After, h.TTL)
	}
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "list_sessions",
		Title:       "List sessions",
		Description: desc,
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.listSessions, noSession[ListSessionsArgs]))
}

type sessionEntry struct {
	Name     string `json:"name"`
	State    string `json:"state"`
	IdleS    int64  `json:"idle_s,omitempty"`
	SavedAgo int64  `json:"saved_s_ago,omitempty"`
	Bytes    int64  `json:"bytes,omitempty"`
	Unsaved  bool   `json:"unsaved,omitempty"`
}

func (s *Server) listSessions(_ context.Context, req *mcp.CallToolRequest, _ ListSessionsArgs) (*mcp.CallToolResult, any, error) {
	list := s.mgr.SessionList(principal(req))
	var b strings.Builder
	fmt.Fprintf(&b, "%d sessions\n", len(list))
	entries := make([]sessionEntry, 0, len(list))
	now := time.Now()
	for _, si := range list {
		e := sessionEntry{Name: si.Name, State: si.State, Bytes: si.Bytes, Unsaved: si.Unsaved}
		fmt.Fprintf(&b, "%s\t%s", si.Name, si.State)
		if !si.LastUsed.IsZero() && si.State != session.StateHibernated {
			e.IdleS = int64(now.Sub(si.LastUsed).Seconds())
			fmt.Fprintf(&b, ", idle %s", now.Sub(si.LastUsed).Round(time.Second))
		}
		if !si.Saved.IsZero() {
			e.SavedAgo = int64(now.Sub(si.Saved).Seconds())
			fmt.Fprintf(&b, ", saved %s ago (%d bytes)", now.Sub(si.Saved).Round(time.Second), si.Bytes)
		}
		switch {
		case si.Unsaved && si.Saved.IsZero():
			b.WriteString(", not saved yet")
		case si.Unsaved:
			b.WriteString(", changed since")
		}
		b.WriteString("\n")
		entries = append(entries, e)
	}
	return &mcp.CallToolResult{
		Content:           []mcp.Content{&mcp.TextContent{Text: strings.TrimRight(b.String(), "\n")}},
		StructuredContent: map[string]any{"sessions": entries},
	}, nil, nil
}
