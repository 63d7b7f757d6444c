// Package mcpserver exposes kiln's sessions as MCP tools: run_python,
// run_shell, write_file, read_file, list_files and reset_session.
package mcpserver

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"path"
	"runtime/debug"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// Version is kiln's version, reported in the MCP handshake.
var Version = "0.1.0"

// Options configure the server.
type Options struct {
	Manager *session.Manager
	// Runtime and Network describe the sandbox for tool descriptions.
	Runtime sandbox.Runtime
	Network string // one sentence on what boxes can reach; "" means no network
	Backend string
	Logger  *slog.Logger
	// NetScope, when set, is the OAuth scope a client's token must hold
	// for its calls to run in boxes with network (see netscope.go).
	NetScope string
	// NetworkFor, when set, gives the network the operator set for a
	// principal (ok false: the server's, as Network describes it). Never
	// the model's to choose: it comes from the server's configuration.
	NetworkFor func(principal string) (net PrincipalNetwork, ok bool)
	// Resources configures what comes back as kiln:// resource links.
	Resources ResourceOptions
}

// Server is kiln's MCP server.
type Server struct {
	mgr  *session.Manager
	opts Options
	log  *slog.Logger
	mcp  *mcp.Server
	res  *resStore // results as resources (resources.go)
}

// New builds the MCP server with its tools.
func New(opts Options) *Server {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{mgr: opts.Manager, opts: opts, log: opts.Logger}
	s.mcp = mcp.NewServer(&mcp.Implementation{Name: "kiln", Title: "kiln sandbox", Version: Version}, &mcp.ServerOptions{
		Instructions: s.instructions(),
		Logger:       opts.Logger,
	})
	s.mcp.AddReceivingMiddleware(undeclared, s.netScoped)
	s.res = newResStore(opts.Manager, opts.Resources)
	s.addTools()
	s.addResources()
	return s
}

// MCP returns the underlying SDK server, to serve on a transport.
func (s *Server) MCP() *mcp.Server { return s.mcp }

// Arguments of the tools. Field docs become the JSON schema descriptions.
type (
	RunPythonArgs struct {
		Code       string            `json:"code" jsonschema:"Python source to run as one cell"`
		Session    string            `json:"session,omitempty" jsonschema:"session name; omit for this connection's default session"`
		TimeoutS   float64           `json:"timeout_s,omitempty" jsonschema:"time limit in seconds"`
		Files      map[string]string `json:"files,omitempty" jsonschema:"per-call mode: files to place in the workspace first, path to content (prefix content with base64: for binary)"`
		Background bool              `json:"background,omitempty" jsonschema:"run as a background job: return at once with a job handle; follow it with job_status, stop it with cancel_job"`
	}
	RunShellArgs struct {
		Command    string            `json:"command" jsonschema:"bash command line to run in the workspace"`
		Session    string            `json:"session,omitempty" jsonschema:"session name; omit for this connection's default session"`
		TimeoutS   float64           `json:"timeout_s,omitempty" jsonschema:"time limit in seconds"`
		Files      map[string]string `json:"files,omitempty" jsonschema:"per-call mode: files to place in the workspace first, path to content (prefix content with base64: for binary)"`
		Background bool              `json:"background,omitempty" jsonschema:"run as a background job: return at once with a job handle; follow it with job_status, stop it with cancel_job"`
	}
	WriteFileArgs struct {
		Path     string `json:"path" jsonschema:"path relative to the workspace; parent directories are created"`
		Content  string `json:"content" jsonschema:"file content"`
		Encoding string `json:"encoding,omitempty" jsonschema:"text (default) or base64"`
		Session  string `json:"session,omitempty" jsonschema:"session name; omit for the default session"`
	}
	ReadFileArgs struct {
		Path    string `json:"path" jsonschema:"path relative to the workspace"`
		Session string `json:"session,omitempty" jsonschema:"session name; omit for the default session"`
	}
	ListFilesArgs struct {
		Path    string `json:"path,omitempty" jsonschema:"directory relative to the workspace; omit for the whole workspace"`
		Session string `json:"session,omitempty" jsonschema:"session name; omit for the default session"`
	}
	ResetSessionArgs struct {
		Session string `json:"session,omitempty" jsonschema:"session name; omit for the default session"`
	}
)

func (s *Server) perCall() bool { return s.mgr.Options().Mode == session.ModePerCall }

func (s *Server) addTools() {
	ro, destructive := true, true
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "run_python",
		Title:       "Run Python",
		Description: s.describeRunPython(s.opts.Network),
		Annotations: &mcp.ToolAnnotations{OpenWorldHint: boolPtr(s.opts.Network != "")},
	}, guard(s, s.runPython, func(a RunPythonArgs) string { return a.Session }))
	if s.opts.Runtime.NoShell == "" { // the wasm backend has none; run_python's description says why
		mcp.AddTool(s.mcp, &mcp.Tool{
			Name:        "run_shell",
			Title:       "Run shell command",
			Description: s.describeRunShell(s.opts.Network),
			Annotations: &mcp.ToolAnnotations{OpenWorldHint: boolPtr(s.opts.Network != "")},
		}, guard(s, s.runShell, func(a RunShellArgs) string { return a.Session }))
	}
	s.addJobTools()
	if s.perCall() {
		return
	}
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "write_file",
		Title:       "Write a file in the sandbox",
		Description: "Write a file into the sandbox workspace (" + workspace + "), creating parent directories. Paths are relative to the workspace; nothing outside it can be written. Use encoding \"base64\" for binary content.",
		Annotations: &mcp.ToolAnnotations{OpenWorldHint: boolPtr(false)},
	}, guard(s, s.writeFile, func(a WriteFileArgs) string { return a.Session }))
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "read_file",
		Title:       "Read a file from the sandbox",
		Description: "Read a file from the sandbox workspace. Images come back as images, text as text, other binary files as base64.",
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: ro, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.readFile, func(a ReadFileArgs) string { return a.Session }))
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "list_files",
		Title:       "List files in the sandbox",
		Description: "List the files under a directory of the sandbox workspace (recursively, up to 1000 entries), with sizes.",
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: ro, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.listFiles, func(a ListFilesArgs) string { return a.Session }))
	mcp.AddTool(s.mcp, &mcp.Tool{
		Name:        "reset_session",
		Title:       "Reset a session",
		Description: "Throw away a session's sandbox: its variables, files and processes. A call still running in that session is cut off. The next call in that session starts a fresh sandbox.",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: &destructive, OpenWorldHint: boolPtr(false)},
	}, guard(s, s.resetSession, func(a ResetSessionArgs) string { return a.Session }))
	s.addSessionTools()
	s.addSnapshotTools()
}

func boolPtr(b bool) *bool { return &b }

// guard makes a panic while handling one call an error result for that
// call: it is logged with its stack, and the session's box is destroyed
// (what it sent may be what caused it). It never takes the server down.
// sessionOf names the session the arguments ask for.
func guard[In any](s *Server, h mcp.ToolHandlerFor[In, any], sessionOf func(In) string) mcp.ToolHandlerFor[In, any] {
	return func(ctx context.Context, req *mcp.CallToolRequest, args In) (res *mcp.CallToolResult, out any, err error) {
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			tool := ""
			if req != nil && req.Params != nil {
				tool = req.Params.Name
			}
			s.log.Error("panic handling a call", "tool", tool, "panic", v, "stack", string(debug.Stack()))
			what := "no sandbox was involved"
			if !s.perCall() && req != nil {
				if name, nerr := sessionName(req, sessionOf(args)); nerr == nil && s.mgr.Reset(principal(req), name) {
					what = fmt.Sprintf("the sandbox of session %q was destroyed; the next call there starts fresh", name)
				}
			} else if s.perCall() {
				what = "its sandbox was destroyed"
			}
			res, out, err = toolError("kiln faulted while handling this call (%v); %s", v, what), nil, nil
		}()
		return h(ctx, req, args)
	}
}

const workspace = boxpolicy.Workspace

// principal identifies the caller: the token's user over HTTP, "local"
// over stdio.
func principal(req *mcp.CallToolRequest) string { return principalOf(req.Extra) }

// sessionName resolves the session a call runs in. A named session is the
// principal's; the default one belongs to the connection: the MCP session
// when there is one, else the principal (stateless HTTP, stdio).
func sessionName(req *mcp.CallToolRequest, name string) (string, error) {
	if name != "" {
		if !session.ValidName(name) {
			return "", session.ErrBadName
		}
		return name, nil
	}
	if req.Session != nil {
		if id := req.Session.ID(); id != "" {
			sum := sha256.Sum256([]byte(id))
			return "default-" + hex.EncodeToString(sum[:4]), nil
		}
	}
	return "default", nil
}

// toolError is a result the model can read and act on (bad arguments, a
// path outside the workspace), as opposed to a fault of kiln.
func toolError(format string, args ...any) *mcp.CallToolResult {
	return &mcp.CallToolResult{
		IsError: true,
		Content: []mcp.Content{&mcp.TextContent{Text: fmt.Sprintf(format, args...)}},
	}
}

func (s *Server) session(req *mcp.CallToolRequest, name string) (*session.Session, error) {
	n, err := sessionName(req, name)
	if err != nil {
		return nil, err
	}
	return s.mgr.Get(principal(req), n)
}

func (s *Server) runPython(ctx context.Context, req *mcp.CallToolRequest, args RunPythonArgs) (*mcp.CallToolResult, any, error) {
	if args.Background {
		return s.startJob(ctx, req, session.Python, args.Code, args.Session, args.TimeoutS, args.Files)
	}
	return s.run(ctx, req, session.Python, args.Code, args.Session, args.TimeoutS, args.Files)
}

func (s *Server) runShell(ctx context.Context, req *mcp.CallToolRequest, args RunShellArgs) (*mcp.CallToolResult, any, error) {
	if args.Background {
		return s.startJob(ctx, req, session.Shell, args.Command, args.Session, args.TimeoutS, args.Files)
	}
	return s.run(ctx, req, session.Shell, args.Command, args.Session, args.TimeoutS, args.Files)
}

const maxCodeBytes = 1 << 20

// checkRun refuses a run call's bad arguments; nil if they are fine.
func checkRun(lang session.Language, code string, timeoutS float64) *mcp.CallToolResult {
	what := "code"
	if lang == session.Shell {
		what = "command"
	}
	switch {
	case strings.TrimSpace(code) == "":
		return toolError("%s is empty", what)
	case len(code) > maxCodeBytes:
		return toolError("%s is %d bytes; the limit is %d. Write large inputs with write_file and run a short script.", what, len(code), maxCodeBytes)
	case timeoutS < 0:
		return toolError("timeout_s must be positive")
	}
	return nil
}

func (s *Server) run(ctx context.Context, req *mcp.CallToolRequest, lang session.Language, code, name string, timeoutS float64, files map[string]string) (*mcp.CallToolResult, any, error) {
	if bad := checkRun(lang, code, timeoutS); bad != nil {
		return bad, nil, nil
	}
	timeout := s.mgr.Timeout(timeoutS)
	log := s.log.With("principal", principal(req), "tool", req.Params.Name)
	ctx, stopProgress := s.liveProgress(ctx, req)
	defer stopProgress()

	if s.perCall() {
		if name != "" {
			return toolError("this server runs every call in a fresh sandbox (per-call mode); there are no sessions, so omit \"session\""), nil, nil
		}
		staged, err := decodeFiles(files)
		if err != nil {
			return toolError("%v", err), nil, nil
		}
		start := time.Now()
		out, produced, err := s.mgr.RunOnce(session.WithPrincipal(ctx, principal(req)), lang, code, staged, timeout)
		if err != nil {
			return s.failure(log, err), nil, nil
		}
		// duration is the client's wait: the box's, the staging, the run
		// (run=) and the collection of produced files.
		log.Info("call", "duration", time.Since(start), "run", out.Duration, "error", out.Error != nil, "timed_out", out.TimedOut)
		return s.renderCall(req, out, produced), nil, nil
	}
	if len(files) > 0 {
		return toolError("\"files\" is for per-call mode; in a session, use write_file"), nil, nil
	}
	sess, err := s.session(req, name)
	if err != nil {
		return toolError("%v", err), nil, nil
	}
	var out *session.Outcome
	start := time.Now()
	if lang == session.Shell {
		out, err = sess.RunShell(ctx, code, timeout)
	} else {
		out, err = sess.RunPython(ctx, code, timeout)
	}
	if err != nil {
		return s.failure(log, err), nil, nil
	}
	log.Info("call", "session", out.Session, "duration", time.Since(start), "run", out.Duration, "error", out.Error != nil, "timed_out", out.TimedOut, "restarted", out.Restarted)
	return s.renderCall(req, out, nil), nil, nil
}

// failure turns an error of kiln's into a result the model can read; the
// details go to the log.
func (s *Server) failure(log *slog.Logger, err error) *mcp.CallToolResult {
	var ae *sandbox.AgentError
	if errors.As(err, &ae) {
		return toolError("%s", ae.Msg)
	}
	if errors.Is(err, session.ErrBadName) || errors.Is(err, session.ErrTooMany) || errors.Is(err, session.ErrShutdown) ||
		errors.Is(err, session.ErrBusy) || errors.Is(err, session.ErrReset) || jobError(err) {
		return toolError("%v", err)
	}
	log.Error("call failed", "err", err)
	return toolError("kiln could not run the call: %v", err)
}

func decodeFiles(files map[string]string) (map[string][]byte, error) {
	out := make(map[string][]byte, len(files))
	total := 0
	for p, content := range files {
		data := []byte(content)
		if b64, ok := strings.CutPrefix(content, "base64:"); ok {
			var err error
			if data, err = base64.StdEncoding.DecodeString(b64); err != nil {
				return nil, fmt.Errorf("files[%q]: invalid base64: %v", p, err)
			}
		}
		total += len(data)
		if total > maxFilesBytes {
			return nil, fmt.Errorf("files add up to more than %d MiB", maxFilesBytes>>20)
		}
		out[p] = data
	}
	return out, nil
}

func (s *Server) writeFile(ctx context.Context, req *mcp.CallToolRequest, args WriteFileArgs) (*mcp.CallToolResult, any, error) {
	data := []byte(args.Content)
	switch args.Encoding {
	case "", "text":
	case "base64":
		var err error
		if data, err = base64.StdEncoding.DecodeString(args.Content); err != nil {
			return toolError("content is not valid base64: %v", err), nil, nil
		}
	default:
		return toolError("encoding must be \"text\" or \"base64\", not %q", args.Encoding), nil, nil
	}
	sess, err := s.session(req, args.Session)
	if err != nil {
		return toolError("%v", err), nil, nil
	}
	err = sess.WithBox(ctx, func(box sandbox.Sandbox) error { return box.WriteFile(ctx, args.Path, data) })
	if err != nil {
		return s.failure(s.log, err), nil, nil
	}
	return textResult(fmt.Sprintf("[session: %s] wrote %d bytes to %s", sess.Name(), len(data), args.Path)), nil, nil
}

func (s *Server) readFile(ctx context.Context, req *mcp.CallToolRequest, args ReadFileArgs) (*mcp.CallToolResult, any, error) {
	sess, err := s.session(req, args.Session)
	if err != nil {
		return toolError("%v", err), nil, nil
	}
	var (
		data []byte
		size int64
	)
	err = sess.WithBox(ctx, func(box sandbox.Sandbox) (err error) {
		data, size, err = box.ReadFile(ctx, args.Path, int64(s.res.opts.InlineBytes))
		return err
	})
	if err != nil {
		return s.failure(s.log, err), nil, nil
	}
	if size > int64(len(data)) {
		return s.linkedFileResult(req, sess, args.Path, data, size), nil, nil
	}
	header := fmt.Sprintf("[session: %s] %s (%d bytes)", sess.Name(), args.Path, size)
	if int64(len(data)) < size {
		header += fmt.Sprintf(", first %d bytes shown", len(data))
	}
	return fileResult(header, args.Path, data), nil, nil
}

// fileResult shows a file the way a person would want to see it.
func fileResult(header, p string, data []byte) *mcp.CallToolResult {
	if mime := imageMIME(p, data); mime != "" {
		return &mcp.CallToolResult{Content: []mcp.Content{
			&mcp.TextContent{Text: header},
			&mcp.ImageContent{MIMEType: mime, Data: data},
		}}
	}
	if utf8.Valid(data) && !strings.ContainsRune(string(data), 0) {
		return textResult(header + "\n" + string(data))
	}
	return &mcp.CallToolResult{Content: []mcp.Content{
		&mcp.TextContent{Text: header + "\nbinary file, returned as base64 in a resource"},
		&mcp.EmbeddedResource{Resource: &mcp.ResourceContents{
			URI:      "file://" + path.Join(workspace, p),
			MIMEType: "application/octet-stream",
			Blob:     data,
		}},
	}}
}

func imageMIME(p string, data []byte) string {
	switch {
	case len(data) >= 8 && string(data[:8]) == "\x89PNG\r\n\x1a\n":
		return "image/png"
	case len(data) >= 3 && string(data[:3]) == "\xff\xd8\xff":
		return "image/jpeg"
	case len(data) >= 6 && (string(data[:6]) == "GIF87a" || string(data[:6]) == "GIF89a"):
		return "image/gif"
	case len(data) >= 12 && string(data[:4]) == "RIFF" && string(data[8:12]) == "WEBP":
		return "image/webp"
	}
	return ""
}

func (s *Server) listFiles(ctx context.Context, req *mcp.CallToolRequest, args ListFilesArgs) (*mcp.CallToolResult, any, error) {
	sess, err := s.session(req, args.Session)
	if err != nil {
		return toolError("%v", err), nil, nil
	}
	var files []fileEntry
	err = sess.WithBox(ctx, func(box sandbox.Sandbox) error {
		list, err := box.ListFiles(ctx, args.Path)
		for _, f := range list {
			files = append(files, fileEntry{Path: f.Path, Size: f.Size, Dir: f.Dir, Symlink: f.Symlink})
		}
		return err
	})
	if err != nil {
		return s.failure(s.log, err), nil, nil
	}
	var b strings.Builder
	fmt.Fprintf(&b, "[session: %s] %d entries under %s\n", sess.Name(), len(files), path.Join(workspace, args.Path))
	for _, f := range files {
		switch {
		case f.Dir:
			fmt.Fprintf(&b, "%s/\n", f.Path)
		case f.Symlink:
			fmt.Fprintf(&b, "%s@\n", f.Path)
		default:
			fmt.Fprintf(&b, "%s\t%d\n", f.Path, f.Size)
		}
	}
	return &mcp.CallToolResult{
		Content:           []mcp.Content{&mcp.TextContent{Text: b.String()}},
		StructuredContent: map[string]any{"session": sess.Name(), "files": files},
	}, nil, nil
}

type fileEntry struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	Dir     bool   `json:"dir,omitempty"`
	Symlink bool   `json:"symlink,omitempty"`
}

func (s *Server) resetSession(ctx context.Context, req *mcp.CallToolRequest, args ResetSessionArgs) (*mcp.CallToolResult, any, error) {
	name, err := sessionName(req, args.Session)
	if err != nil {
		return toolError("%v", err), nil, nil
	}
	if s.mgr.Reset(principal(req), name) {
		return textResult(fmt.Sprintf("[session: %s] reset: the sandbox was destroyed; the next call starts a fresh one", name)), nil, nil
	}
	return textResult(fmt.Sprintf("[session: %s] had no sandbox; nothing to reset", name)), nil, nil
}

func textResult(text string) *mcp.CallToolResult {
	return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: text}}}
}
