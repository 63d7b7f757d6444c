package mcpserver

import (
	"fmt"
	"strings"

	"kiln/internal/session"
)

// Tool descriptions are generated from the live configuration: they tell
// the model what is true of this server (network, limits, persistence,
// libraries), nothing more.

// facts are what holds for every call; network is the sentence on what
// the caller's boxes can reach ("": none).
func (s *Server) facts(network string) string {
	o := s.mgr.Options()
	var b strings.Builder
	if s.perCall() {
		b.WriteString("Every call runs in a brand-new sandbox that is destroyed afterwards: nothing persists between calls (no variables, files or processes). Pass input files with \"files\"; files the call writes under " + workspace + " come back with the result. ")
	} else {
		b.WriteString("State persists within a session: variables, imports, files in " + workspace + " and background processes. Each result names its session; pass that name as \"session\" to continue in it, or a new name to start another. ")
	}
	if network == "" {
		b.WriteString("The sandbox has NO network access (only its own loopback). ")
	} else {
		b.WriteString(network + " ")
	}
	fmt.Fprintf(&b, "Time limit %gs per call by default (timeout_s may raise it to %gs); at the limit the code is interrupted, and if it does not stop the sandbox is destroyed. ",
		o.DefaultTimeout.Seconds(), o.MaxTimeout.Seconds())
	fmt.Fprintf(&b, "Limits: %d MiB memory, %d MiB workspace, %d processes. Output over %d characters per stream is cut in the middle. ",
		o.Limits.MemoryBytes>>20, o.Limits.WorkspaceBytes>>20, o.Limits.Pids, s.shownOutput())
	b.WriteString(s.describeResources())
	if s.perCall() {
		fmt.Fprintf(&b, "At most %d sandboxes run at once; when all are in use a call waits up to %gs, then returns a \"busy\" error: retry it later. ",
			o.MaxBoxes, o.BoxWait.Seconds())
	} else {
		fmt.Fprintf(&b, "You may hold at most %d live sessions (the server %d in all, with at most %d sandboxes at once); reset_session frees one. When all sandboxes are in use a call waits up to %gs, then returns a \"busy\" error: retry it later. ",
			o.MaxSessionsPerPrincipal, o.MaxSessions, o.MaxBoxes, o.BoxWait.Seconds())
	}
	b.WriteString("The working directory is " + workspace + ".")
	return b.String()
}

func (s *Server) describeRunPython(network string) string {
	rt := s.opts.Runtime
	var b strings.Builder
	b.WriteString("Run Python code in a sandbox, like a notebook cell. ")
	if rt.Python != "" {
		fmt.Fprintf(&b, "Python %s", rt.Python)
		if len(rt.Libraries) > 0 {
			fmt.Fprintf(&b, " with %s installed", strings.Join(rt.Libraries, ", "))
		}
		b.WriteString(". ")
	}
	b.WriteString("The value of the last expression is shown. matplotlib figures (plt.show() or left open) come back as PNG images; display(obj) shows rich objects (DataFrames as tables). Exceptions come back with a traceback. ")
	for _, n := range rt.Notes {
		b.WriteString(n + " ")
	}
	if rt.NoShell != "" {
		b.WriteString("There is no run_shell tool: " + rt.NoShell + ". ")
	}
	b.WriteString(s.facts(network))
	b.WriteString(s.describeBackground())
	return b.String()
}

func (s *Server) describeRunShell(network string) string {
	return "Run a bash command line in the sandbox; stdout, stderr and the exit status come back. " + s.sharedWith() + s.facts(network) + s.describeBackground()
}

func (s *Server) sharedWith() string {
	if s.perCall() {
		return ""
	}
	return "It shares the workspace and session with run_python. "
}

func (s *Server) instructions() string {
	mode := "sessions keep state between calls"
	if s.mgr.Options().Mode == session.ModePerCall {
		mode = "every call runs in a fresh sandbox"
	}
	if s.opts.Runtime.NoShell != "" {
		return "kiln runs code in an isolated sandbox (" + s.opts.Backend + " backend; " + mode + "). Use run_python for computation, data and charts; there is no shell: " + s.opts.Runtime.NoShell + "."
	}
	return "kiln runs code in an isolated sandbox (" + s.opts.Backend + " backend; " + mode + "). Use run_python for computation, data and charts, run_shell for commands."
}
