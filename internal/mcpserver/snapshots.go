package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// Fork, snapshot and roll back sessions (session/snapshot.go).

type (
	ForkSessionArgs struct {
		Session    string `json:"session,omitempty" jsonschema:"the session to fork; omit for the default session"`
		NewSession string `json:"new_session" jsonschema:"name of the new session (1-64 letters, digits, '.', '_' or '-'); it must not exist yet"`
	}
	SnapshotSessionArgs struct {
		Session string `json:"session,omitempty" jsonschema:"session name; omit for the default session"`
		Name    string `json:"name" jsonschema:"snapshot name (1-64 letters, digits, '.', '_' or '-'); an existing snapshot of that name is replaced"`
	}
	RestoreSessionArgs struct {
		Session string `json:"session,omitempty" jsonschema:"session name; omit for the default session"`
		Name    string `json:"name" jsonschema:"the snapshot to roll back to"`
	}
	ListSnapshotsArgs struct {
		Session string `json:"session,omitempty" jsonschema:"session name; omit for the default session"`
	}
	DeleteSnapshotArgs struct {
		Session string `json:"session,omitempty" jsonschema:"session name; omit for the default session"`
		Name    string `json:"name" jsonschema:"the snapshot to delete"`
	}
)

// keptSentence says what a snapshot keeps, for every tool's description.
const keptSentence = "A snapshot keeps the workspace's files and directories and the Python kernel's global variables (DataFrames, arrays, functions, classes, lambdas; modules are imported again), each variable saved on its own. It does not keep running processes or background jobs, open files or sockets, symbolic links, what is outside the workspace (/tmp), or what cannot be pickled (a generator): those are named in the result. Variables that shared one object get a copy each. Random generators are reseeded in the new sandbox."

func (s *Server) addSnapshotTools() {
	destructive := true
	o := s.mgr.Options().Snapshots
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "fork_session",
		Title:       "Fork a session",
		Description: "Make a new session that starts as a copy of a session as it is now, to try something risky in the copy while the original keeps running untouched. " + keptSentence + " The fork runs in a fresh sandbox with the same limits.",
		Annotations: &mcp.ToolAnnotations{OpenWorldHint: boolPtr(false)},
	}, guard(s, s.forkSession, func(a ForkSessionArgs) string { return a.NewSession }))
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:  "snapshot_session",
		Title: "Snapshot a session",
		Description: fmt.Sprintf("Save a session's state under a name, to roll back to it later with restore_session. The session keeps running. %s A session keeps at most %d snapshots; your snapshots together may take %d MiB.",
			keptSentence, o.Max, o.Quota>>20),
		Annotations: &mcp.ToolAnnotations{OpenWorldHint: boolPtr(false)},
	}, guard(s, s.snapshotSession, func(a SnapshotSessionArgs) string { return a.Session }))
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "restore_session",
		Title:       "Roll a session back to a snapshot",
		Description: "Roll a session back to one of its snapshots: its sandbox is replaced by a fresh one holding the snapshot's files and variables, and everything since the snapshot is gone. " + keptSentence,
		Annotations: &mcp.ToolAnnotations{DestructiveHint: &destructive, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.restoreSession, func(a RestoreSessionArgs) string { return a.Session }))
	ro := true
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "list_snapshots",
		Title:       "List a session's snapshots",
		Description: "List a session's snapshots: name, when it was taken, its size, and what it could not keep.",
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: ro, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.listSnapshots, func(a ListSnapshotsArgs) string { return a.Session }))
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "delete_snapshot",
		Title:       "Delete a snapshot",
		Description: "Delete one of a session's snapshots, to free room for another.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: &destructive, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.deleteSnapshot, func(a DeleteSnapshotArgs) string { return a.Session }))
}

// snapshotFailure is an error of a snapshot tool as a result: what the
// model can act on verbatim, the rest through failure.
func (s *Server) snapshotFailure(req *mcp.CallToolRequest, err error) *mcp.CallToolResult {
	for _, known := range []error{session.ErrNoSnapshot, session.ErrSnapshotExists, session.ErrSnapshotsFull,
		session.ErrSnapshotQuota, session.ErrStateQuota, session.ErrNoSnapshotBoxes, session.ErrPerCallMode, session.ErrNothingToSave, session.ErrNoSession,
		sandbox.ErrCorruptSnapshot, sandbox.ErrSnapshotTooLarge, sandbox.ErrSnapshotFormat} {
		if errors.Is(err, known) {
			return toolError("%v", err)
		}
	}
	return s.failure(s.log.With("principal", principal(req), "tool", req.Params.Name), err)
}

func (s *Server) forkSession(ctx context.Context, req *mcp.CallToolRequest, args ForkSessionArgs) (*mcp.CallToolResult, any, error) {
	src, err := sessionName(req, args.Session)
	if err != nil {
		return toolError("%v", err), nil, nil
	}
	if !session.ValidName(args.NewSession) {
		return toolError("new_session: %v", session.ErrBadName), nil, nil
	}
	rep, err := s.mgr.Fork(ctx, principal(req), src, args.NewSession)
	if err != nil {
		return s.snapshotFailure(req, err), nil, nil
	}
	return textResult(fmt.Sprintf("[session: %s] forked from session %q in %s (%s of state).%s Continue in the fork with session: %q; %q keeps running unchanged.",
		args.NewSession, src, ms(rep.Took), size(rep.Info.Bytes), describeKept(rep.Info, rep.Dropped), args.NewSession, src)), nil, nil
}

func (s *Server) snapshotSession(ctx context.Context, req *mcp.CallToolRequest, args SnapshotSessionArgs) (*mcp.CallToolResult, any, error) {
	sess, err := s.session(req, args.Session)
	if err != nil {
		return s.snapshotFailure(req, err), nil, nil
	}
	info, err := sess.Snapshot(ctx, args.Name)
	if err != nil {
		return s.snapshotFailure(req, err), nil, nil
	}
	return textResult(fmt.Sprintf("[session: %s] snapshot %q saved in %s (%s).%s Roll back to it with restore_session.",
		sess.Name(), args.Name, ms(info.Took), size(info.Bytes), describeKept(info, nil))), nil, nil
}

func (s *Server) restoreSession(ctx context.Context, req *mcp.CallToolRequest, args RestoreSessionArgs) (*mcp.CallToolResult, any, error) {
	sess, err := s.session(req, args.Session)
	if err != nil {
		return s.snapshotFailure(req, err), nil, nil
	}
	rep, err := sess.Restore(ctx, args.Name)
	if err != nil {
		return s.snapshotFailure(req, err), nil, nil
	}
	return textResult(fmt.Sprintf("[session: %s] rolled back to snapshot %q (taken %s) in %s (%s); everything since is gone.%s",
		sess.Name(), args.Name, rep.Info.Created.Format(time.RFC3339), ms(rep.Took), size(rep.Info.Bytes), describeKept(rep.Info, rep.Dropped))), nil, nil
}

func (s *Server) listSnapshots(ctx context.Context, req *mcp.CallToolRequest, args ListSnapshotsArgs) (*mcp.CallToolResult, any, error) {
	name, err := sessionName(req, args.Session)
	if err != nil {
		return toolError("%v", err), nil, nil
	}
	list, err := s.mgr.Snapshots(principal(req), name)
	if err != nil {
		return s.snapshotFailure(req, err), nil, nil
	}
	if len(list) == 0 {
		return textResult(fmt.Sprintf("[session: %s] has no snapshots", name)), nil, nil
	}
	var b strings.Builder
	fmt.Fprintf(&b, "[session: %s] %d snapshots (at most %d):\n", name, len(list), s.mgr.Options().Snapshots.Max)
	for _, e := range list {
		if e.Unreadable != "" {
			fmt.Fprintf(&b, "- %s: cannot be read (%s), %s; it still counts against the limits: delete_snapshot it\n", e.Name, e.Unreadable, size(e.Bytes))
			continue
		}
		fmt.Fprintf(&b, "- %s: taken %s, %s, %d variables", e.Name, e.Created.Format(time.RFC3339), size(e.Bytes), len(e.Saved))
		if len(e.Dropped) > 0 {
			fmt.Fprintf(&b, ", not kept: %s", strings.Join(e.Dropped, "; "))
		}
		b.WriteString("\n")
	}
	return textResult(b.String()), nil, nil
}

func (s *Server) deleteSnapshot(ctx context.Context, req *mcp.CallToolRequest, args DeleteSnapshotArgs) (*mcp.CallToolResult, any, error) {
	name, err := sessionName(req, args.Session)
	if err != nil {
		return toolError("%v", err), nil, nil
	}
	if err := s.mgr.DeleteSnapshot(principal(req), name, args.Name); err != nil {
		return s.snapshotFailure(req, err), nil, nil
	}
	return textResult(fmt.Sprintf("[session: %s] snapshot %q deleted", name, args.Name)), nil, nil
}

// describeKept says what a snapshot saved and what it and the load
// dropped.
func describeKept(info *sandbox.SnapshotInfo, loadDropped []string) string {
	var b strings.Builder
	if len(info.Saved) > 0 {
		fmt.Fprintf(&b, " Variables kept: %s.", strings.Join(info.Saved, ", "))
	} else {
		b.WriteString(" No variables kept.")
	}
	b.WriteString(" Workspace files kept.")
	if d := append(append([]string(nil), info.Dropped...), loadDropped...); len(d) > 0 {
		fmt.Fprintf(&b, " Not kept: %s.", strings.Join(d, "; "))
	}
	return b.String()
}

func ms(d time.Duration) string { return fmt.Sprintf("%d ms", d.Milliseconds()) }

func size(n int64) string {
	switch {
	case n >= 10<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 10<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}
