package session

import (
	"strings"
	"testing"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// TestLimitNotesPerCall: in per-call mode, where nothing of the box is
// kept either way, a limit's note is a whole sentence, with no dangling
// separator where the session mode says what survived.
func TestLimitNotesPerCall(t *testing.T) {
	m := &Manager{opts: Options{Mode: ModePerCall, Limits: sandbox.Limits{Pids: 32, WorkspaceBytes: 8 << 20}}}
	out := &Outcome{ExecResult: &agentproto.ExecResult{Stderr: agentproto.Stream{Text: "dd: error writing 'x': No space left on device\n"}}}
	m.explainLimits(out, nil, sandbox.LimitHits{PidsRefused: 2})
	for _, want := range []string{"the process limit (32) was reached", "workspace is full (8 MiB)"} {
		if !strings.Contains(out.Note, want) {
			t.Errorf("note %q does not say %q", out.Note, want)
		}
	}
	if strings.Contains(out.Note, "; ;") || strings.HasSuffix(strings.TrimSpace(out.Note), ";") {
		t.Errorf("note %q has a dangling separator", out.Note)
	}
}
