package gvisor

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kiln/internal/sandbox"
)

// TestPrecompiledSeccomp checks that the sentry of a box started by kiln's
// runsc build installs a precompiled seccomp program instead of building
// one (runsc_build.go), as its debug log says.
func TestPrecompiledSeccomp(t *testing.T) {
	if os.Getenv("KILN_RUNSC") != "" {
		t.Skip("KILN_RUNSC is not kiln's build of runsc")
	}
	b := newTestBackend(t, Options{Cold: true, Debug: true})
	sb, err := b.Create(context.Background(), sandbox.Spec{ID: "precompiled"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if got := strings.TrimSpace(run(t, sb, "print(2+2)")); got != "4" {
		t.Fatalf("got %q", got)
	}
	bx := sb.(*gvBox).bx
	logs, _ := filepath.Glob(filepath.Join(bx.dir, "logs", "*boot*"))
	if len(logs) == 0 {
		t.Fatalf("no sentry debug log under %s", bx.dir)
	}
	var all string
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			t.Fatal(err)
		}
		all += string(b)
	}
	if !strings.Contains(all, "Loaded precompiled seccomp instructions") {
		i := strings.Index(all, "No precompiled program")
		if i < 0 {
			i = 0
		}
		t.Errorf("the sentry built its seccomp program at start: %.300s", all[i:])
	}
}
