package mcpserver_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// noShell is a backend whose runtime has no shell (as the wasm backend's).
type noShell struct{ sandbox.Backend }

const noShellWhy = "the boxes are WebAssembly, with no programs to start"

func (noShell) Runtime() sandbox.Runtime {
	return sandbox.Runtime{Python: "3.14", NoShell: noShellWhy, Notes: []string{"Only the standard library."}}
}

// TestNoShellRuntime: a backend without a shell gets no run_shell tool,
// and the model is told why, in run_python's description and the
// server's instructions.
func TestNoShellRuntime(t *testing.T) {
	b := noShell{sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})}
	for _, mode := range []session.Mode{session.ModeSession, session.ModePerCall} {
		t.Run(string(mode), func(t *testing.T) {
			srv := serve(t, b, session.Options{Mode: mode})
			cs := dial(t, srv)
			list, err := cs.ListTools(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, tool := range list.Tools {
				names = append(names, tool.Name)
				if tool.Name == "run_python" {
					if !strings.Contains(tool.Description, "no run_shell tool: "+noShellWhy) || !strings.Contains(tool.Description, "Only the standard library.") {
						t.Errorf("run_python does not say why there is no shell: %s", tool.Description)
					}
				}
			}
			if slices.Contains(names, "run_shell") {
				t.Errorf("run_shell offered by a backend without a shell: %v", names)
			}
			if !strings.Contains(cs.InitializeResult().Instructions, noShellWhy) {
				t.Errorf("instructions: %q", cs.InitializeResult().Instructions)
			}
		})
	}
}
