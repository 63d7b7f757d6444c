package jail_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// TestHomeOutsideWorkspace: HOME and XDG_CACHE_HOME are a box-private
// directory outside /work, so what fontconfig, matplotlib and tools that
// write under ~ leave behind never comes back as files of a per-call
// result. The same values as the gVisor backend's (HOME=/tmp/home).
func TestHomeOutsideWorkspace(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    func(testing.TB) sandboxBackend
	}{
		{"direct", func(t testing.TB) sandboxBackend { return newBackend(t) }},
		{"zygote", func(t testing.TB) sandboxBackend { return newZygoteBackend(t) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.b(t)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			box, err := b.Create(ctx, sandbox.Spec{ID: "home-" + tc.name, Preload: []string{"matplotlib"}})
			if err != nil {
				t.Fatal(err)
			}
			defer box.Close()
			res, err := box.RunPython(ctx, `
import os, pathlib
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.set_title("fonts: é ✓")
ax.text(0.5, 0.5, "text")
fig.savefig("/tmp/fig.png")
(pathlib.Path.home() / ".config" / "tool").mkdir(parents=True, exist_ok=True)
(pathlib.Path.home() / ".tool_history").write_text("x")
st = os.stat(os.path.expanduser("~"))
print(os.environ["HOME"], os.environ["XDG_CACHE_HOME"], oct(st.st_mode & 0o777), st.st_uid == os.getuid())
`, sandbox.ExecOptions{})
			if err != nil || res.Error != nil {
				t.Fatalf("%v %+v %s", err, res.Error, res.Stderr.Text)
			}
			if got, want := strings.TrimSpace(res.Stdout.Text), "/tmp/home /tmp/home/.cache 0o700 True"; got != want {
				t.Errorf("HOME XDG_CACHE_HOME mode owned: got %q, want %q", got, want)
			}
			sh, err := box.RunShell(ctx, `fc-list >/dev/null 2>&1; fc-cache >/dev/null 2>&1; cd ~ && echo "$HOME"; ls -A /work`, sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			lines := strings.Split(strings.TrimSpace(sh.Stdout.Text), "\n")
			if lines[0] != "/tmp/home" {
				t.Errorf("a shell's HOME is %q", lines[0])
			}
			if junk := lines[1:]; len(junk) > 0 {
				t.Errorf("fontconfig, matplotlib and ~ writes left files in /work: %v", junk)
			}
		})
	}
}

type sandboxBackend interface {
	Create(context.Context, sandbox.Spec) (sandbox.Sandbox, error)
}
