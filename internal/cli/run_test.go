package cli

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"kiln/internal/sandbox/sandboxtest"
)

func TestMain(m *testing.M) {
	MaybeInit() // `kiln run` on the jail re-executes this binary as the box init
	os.Exit(m.Run())
}

func TestVisible(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"plain text\n\tindented", "plain text\n\tindented"},
		{"\x1b]0;pwned\x07", `\x1b]0;pwned\a`},
		{"\x1b[2J\x1b[H", `\x1b[2J\x1b[H`},
		{"a\rb\bc\x00\x7f", `a\rb\bc\x00\x7f`},
		{"csi \u009b31m", `csi \u009b31m`},
		{"bad \xff utf-8, good é ✓", "bad \uFFFD utf-8, good é ✓"},
	} {
		if got := visible(tc.in); got != tc.want {
			t.Errorf("visible(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestRunShowsNoControlCharacters runs a cell that writes terminal escapes
// (a window-title OSC, clear screen, BEL, CR, a C1 CSI) through `kiln run`
// on the jail and checks that none reaches the operator raw.
func TestRunShowsNoControlCharacters(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("kiln run on the jail needs root (user namespaces with a uid range, cgroups)")
	}
	agent := sandboxtest.BuildAgent(t)
	code := `import sys; print("\x1b]0;pwned\x07title\x1b]52;c;Y3VybCBldmlsfHNo\x07"); print("\x1b[2Jcleared\a"); sys.stderr.write("err\r\x9b31m\n"); 42`
	var stdout, stderr bytes.Buffer
	rc := Main([]string{"run", "--agent", agent, "--zygote=false", "--preload", "", "-c", code}, &stdout, &stderr)
	out := stdout.String()
	if rc != 0 {
		t.Fatalf("kiln run exited %d\nstdout:\n%s\nstderr:\n%s", rc, out, stderr.String())
	}
	for i, r := range out {
		if (r < 0x20 && r != '\n' && r != '\t') || (r >= 0x7f && r <= 0x9f) {
			t.Fatalf("control character %U at %d reaches the terminal:\n%q", r, i, out)
		}
	}
	for _, want := range []string{`\x1b]0;pwned\atitle`, `\x1b]52;c;`, `\x1b[2Jcleared\a`, `err\r\u009b31m`, "42"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}
