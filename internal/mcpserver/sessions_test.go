package mcpserver_test

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// TestListSessionsHibernated: list_sessions shows a hibernated session as
// such, and the call that resumes it says so in its result.
func TestListSessionsHibernated(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	srv := serve(t, b, session.Options{Hibernate: session.HibernateOptions{
		Dir: t.TempDir(), After: 200 * time.Millisecond, CheckpointEvery: -1,
	}})
	cs := dial(t, srv)
	if res := call(t, cs, "list_sessions", nil); res.IsError || text(res) != "0 sessions" {
		t.Errorf("no sessions yet: %q", text(res))
	}
	if res := call(t, cs, "run_python", map[string]any{"session": "nap", "code": "x = 41"}); res.IsError {
		t.Fatal(text(res))
	}
	if got := text(call(t, cs, "list_sessions", nil)); !regexp.MustCompile(`(?m)^nap\tlive, idle \d+s, not saved yet$`).MatchString(got) {
		t.Errorf("a live session: %q", got)
	}
	hibernated := regexp.MustCompile(`(?m)^nap\thibernated, saved \d+s ago \(\d+ bytes\)$`)
	deadline := time.Now().Add(30 * time.Second)
	for !hibernated.MatchString(text(call(t, cs, "list_sessions", nil))) {
		if time.Now().After(deadline) {
			t.Fatalf("list_sessions never showed the session hibernated: %q", text(call(t, cs, "list_sessions", nil)))
		}
		time.Sleep(50 * time.Millisecond)
	}
	res := call(t, cs, "run_python", map[string]any{"session": "nap", "code": "x + 1"})
	got := text(res)
	if res.IsError || !strings.Contains(got, "Out: 42") ||
		!regexp.MustCompile(`\[kiln: resumed this session from hibernation in [0-9.]+m?s \(saved \d+s ago\)`).MatchString(got) ||
		strings.Contains(got, "new sandbox") {
		t.Errorf("the resuming call: %q", got)
	}
}
