package mcpserver_test

import (
	"regexp"
	"strings"
	"testing"

	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// Through a client, on every backend: a fork diverges from its source, a
// rollback restores, and the results say what they took and dropped.
func TestSnapshotTools(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := connect(t, b, session.ModeSession)
		mustText := func(tool string, args map[string]any, want string) string {
			t.Helper()
			res := call(t, cs, tool, args)
			got := text(res)
			if res.IsError || !strings.Contains(got, want) {
				t.Fatalf("%s: %q (error %v), want %q", tool, got, res.IsError, want)
			}
			return got
		}
		mustText("run_python", map[string]any{"session": "a", "code": "x = [1, 2]\ng = (i for i in x)\nopen('f.txt', 'w').write('one')"}, "")
		got := mustText("fork_session", map[string]any{"session": "a", "new_session": "b"}, "[session: b] forked from session \"a\"")
		if !regexp.MustCompile(`in \d+ ms \(\d+ (bytes|KiB|MiB) of state\)`).MatchString(got) || !strings.Contains(got, "g: cannot pickle 'generator' object") {
			t.Errorf("fork result: %s", got)
		}
		mustText("run_python", map[string]any{"session": "b", "code": "x.append(3)\nimport os; os.remove('f.txt')"}, "")
		mustText("run_python", map[string]any{"session": "a", "code": "print(x, open('f.txt').read())"}, "[1, 2] one")
		mustText("run_python", map[string]any{"session": "b", "code": "print(x)"}, "[1, 2, 3]")

		mustText("snapshot_session", map[string]any{"session": "a", "name": "before"}, "snapshot \"before\" saved")
		mustText("run_python", map[string]any{"session": "a", "code": "x = None"}, "")
		mustText("restore_session", map[string]any{"session": "a", "name": "before"}, "rolled back")
		mustText("run_python", map[string]any{"session": "a", "code": "print(x)"}, "[1, 2]")
		mustText("list_snapshots", map[string]any{"session": "a"}, "- before: taken")

		for _, bad := range []struct {
			tool string
			args map[string]any
			want string
		}{
			{"restore_session", map[string]any{"session": "a", "name": "nope"}, "no such snapshot"},
			{"fork_session", map[string]any{"session": "a", "new_session": "b"}, "already exists"},
			{"fork_session", map[string]any{"session": "ghost", "new_session": "c"}, "no such session"},
			{"fork_session", map[string]any{"session": "a", "new_session": "../x"}, "session names"},
			{"snapshot_session", map[string]any{"session": "a", "name": "a/b"}, "session names"},
		} {
			res := call(t, cs, bad.tool, bad.args)
			if !res.IsError || !strings.Contains(text(res), bad.want) || strings.Contains(text(res), "kiln could not") {
				t.Errorf("%s %v: %q", bad.tool, bad.args, text(res))
			}
		}
	})
}
