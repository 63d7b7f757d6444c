package cli

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// kiln runs Main with args and returns its exit status and what it wrote.
func kiln(t *testing.T, args ...string) (rc int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	rc = Main(args, &out, &errb)
	return rc, out.String(), errb.String()
}

// TestUsage: no command and an unknown one are usage errors (status 2, the
// usage on stderr); help and version answer on stdout.
func TestUsage(t *testing.T) {
	rc, out, errs := kiln(t)
	if rc != 2 || out != "" || errs != usage {
		t.Errorf("no command: status %d, stdout %q, stderr %q", rc, out, errs)
	}
	rc, out, errs = kiln(t, "frobnicate")
	if rc != 2 || out != "" || !strings.HasPrefix(errs, `kiln: unknown command "frobnicate"`) || !strings.HasSuffix(errs, usage) {
		t.Errorf("unknown command: status %d, stdout %q, stderr %q", rc, out, errs)
	}
	for _, h := range []string{"help", "-h", "--help"} {
		if rc, out, errs := kiln(t, h); rc != 0 || out != usage || errs != "" {
			t.Errorf("%s: status %d, stdout %q, stderr %q", h, rc, out, errs)
		}
	}
	for _, v := range []string{"version", "--version"} {
		if rc, out, _ := kiln(t, v); rc != 0 || out != "kiln "+mcpserver.Version+"\n"+featureLines() {
			t.Errorf("%s: status %d, stdout %q", v, rc, out)
		}
	}
	for _, cmd := range []string{"mcp", "serve", "run", "install", "config print", "image build", "doctor"} {
		if !strings.Contains(usage, "kiln "+cmd) {
			t.Errorf("the usage does not list kiln %s", cmd)
		}
	}
}

// TestCommandHelp: "kiln <command> -h" lists the command's flags on
// stderr and exits 0, without starting anything.
func TestCommandHelp(t *testing.T) {
	for _, c := range []struct {
		args  []string
		flags []string
	}{
		{[]string{"mcp", "-h"}, []string{"-backend", "-mode", "-timeout", "-memory", "-max-output", "-allow-net", "-max-boxes"}},
		{[]string{"serve", "-h"}, []string{"-addr", "-token-file", "-backend"}},
		{[]string{"run", "-h"}, []string{"-c", "-f", "-shell", "-images"}},
		{[]string{"doctor", "-h"}, []string{"-backend"}},
		{[]string{"install", "-h"}, []string{"-write", "-print", "-scope", "-backend", "-config"}},
		{[]string{"config", "print", "-h"}, []string{"-addr", "-config", "-backend", "-zygote"}},
		{[]string{"image", "build", "-h"}, []string{"-force", "-agent"}},
	} {
		rc, out, errs := kiln(t, c.args...)
		if rc != 0 || out != "" {
			t.Errorf("%v: status %d, stdout %q", c.args, rc, out)
		}
		if !strings.Contains(errs, "Usage of kiln ") {
			t.Errorf("%v: no usage line:\n%s", c.args, errs)
		}
		for _, f := range c.flags {
			if !strings.Contains(errs, "  "+f+" ") && !strings.Contains(errs, "  "+f+"\n") {
				t.Errorf("%v: the help does not list %s:\n%s", c.args, f, errs)
			}
		}
	}
}

// TestFlagErrors: bad flags and arguments are refused with status 1 and a
// message on stderr that says what is wrong, before any backend starts
// (none could here: these tests run without root).
func TestFlagErrors(t *testing.T) {
	t.Setenv("KILN_TOKEN", "")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"mcp", "--no-such-flag"}, "flag provided but not defined: -no-such-flag"},
		{[]string{"serve", "--no-such-flag"}, "flag provided but not defined: -no-such-flag"},
		{[]string{"run", "--no-such-flag"}, "flag provided but not defined: -no-such-flag"},
		{[]string{"doctor", "--no-such-flag"}, "flag provided but not defined: -no-such-flag"},
		{[]string{"mcp", "--memory", "lots"}, `invalid value "lots" for flag -memory`},
		{[]string{"mcp", "--timeout", "5"}, `invalid value "5" for flag -timeout`},
		{[]string{"mcp", "--mode", "forever"}, `--mode must be session or per-call, not "forever"`},
		{[]string{"serve", "--mode", "forever"}, `--mode must be session or per-call, not "forever"`},
		{[]string{"mcp", "--allow-net", "ex!ample.com"}, "--allow-net: egress: invalid policy entry"},
		{[]string{"mcp", "--allow-net", "example.org", "--egress-listen", "10.0.0.1"}, "--egress-listen is for backends whose boxes reach the gateway over a network (kubernetes); the jail backend"},
		{[]string{"mcp", "--backend", "kubernetes", "--allow-net", "example.org", "--egress-listen", "no.such"}, "--egress-listen: ParseAddr"},
		{[]string{"serve", "--addr", "0.0.0.0:8080"}, "refusing to listen on a non-loopback address without a token"},
		{[]string{"serve", "--addr", "nonsense"}, `parsing address "nonsense"`},
		{[]string{"run"}, "give code with -c CODE or -f FILE"},
		{[]string{"run", "-c", "1", "-f", "x.py"}, "give -c or -f, not both"},
		{[]string{"run", "-f", filepath.Join(t.TempDir(), "missing.py")}, "missing.py: no such file or directory"},
		{[]string{"install"}, "usage: kiln install claude-desktop|claude-code|cursor|vscode [--write]"},
		{[]string{"install", "vscode", "extra"}, "usage: kiln install claude-desktop|claude-code|cursor|vscode [--write]"},
		{[]string{"install", "emacs"}, `unknown client "emacs"`},
		{[]string{"config"}, "usage: kiln config print"},
		{[]string{"config", "print", "--no-such-flag"}, "flag provided but not defined: -no-such-flag"},
		{[]string{"config", "print", "--config", filepath.Join(t.TempDir(), "none.toml")}, "none.toml: no such file or directory"},
		{[]string{"mcp", "--config", filepath.Join(t.TempDir(), "none.toml")}, "none.toml: no such file or directory"},
		{[]string{"image"}, "usage: kiln image build"},
		{[]string{"image", "destroy"}, "usage: kiln image build"},
	} {
		rc, out, errs := kiln(t, c.args...)
		if rc != 1 || out != "" || !strings.Contains(errs, c.want) {
			t.Errorf("kiln %s: status %d, stdout %q, stderr %q; want status 1 and %q", strings.Join(c.args, " "), rc, out, errs, c.want)
		}
	}
}

// TestRunPrinting: what `kiln run` prints for a result, through the same
// client call and printer it uses, on the in-process backend: text as
// the client gets it, images listed or saved, status 1 for a failure.
func TestRunPrinting(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	mgr := session.NewManager(session.Options{Backend: b, Mode: session.ModePerCall})
	t.Cleanup(mgr.Close)
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: b.Name()})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	run := func(tool string, args map[string]any, images string) (string, bool) {
		t.Helper()
		res, err := callInMemory(ctx, srv, tool, args)
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		printResult(&out, res, images)
		return out.String(), res.IsError
	}

	if out, failed := run("run_python", map[string]any{"code": "print('hi')\n6 * 7"}, ""); failed || out != "hi\nOut: 42\n" {
		t.Errorf("a cell: failed %v, printed %q", failed, out)
	}
	if out, failed := run("run_shell", map[string]any{"command": "echo nope >&2; exit 3"}, ""); !failed || out != "stderr:\nnope\nexit status 3\n" {
		t.Errorf("a failing command: failed %v, printed %q", failed, out)
	}
	png := "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYPgPAAEDAQAIicLsAAAAAElFTkSuQmCC"
	cell := "import base64\nclass Img:\n    def _repr_png_(self): return base64.b64decode('" + png + "')\n    def __repr__(self): return 'Img'\ndisplay(Img())\nImg()"
	if out, _ := run("run_python", map[string]any{"code": cell}, ""); out != "Img (image below)\nOut: Img (image below)\n[image 1: image/png, 69 bytes; save with --images DIR]\n[image 2: image/png, 69 bytes; save with --images DIR]\n" {
		t.Errorf("images without --images: %q", out)
	}
	dir := t.TempDir()
	out, _ := run("run_python", map[string]any{"code": cell}, dir)
	want := "[image 1 saved to " + filepath.Join(dir, "kiln-image-1.png") + "]\n[image 2 saved to " + filepath.Join(dir, "kiln-image-2.png") + "]\n"
	if !strings.HasSuffix(out, want) {
		t.Errorf("images with --images: %q, want it to end with %q", out, want)
	}
	if data, err := os.ReadFile(filepath.Join(dir, "kiln-image-2.png")); err != nil || string(data[:4]) != "\x89PNG" {
		t.Errorf("the saved image: %v %q", err, data)
	}
	out, _ = run("run_shell", map[string]any{"command": "printf 'ok\\033]0;title\\a\\n'; head -c 4 /dev/zero | tr '\\0' '\\377' > raw.bin"}, "")
	if out != "ok\\x1b]0;title\\a\nfile raw.bin (4 bytes, base64 in a resource)\n[resource file:///work/raw.bin, 4 bytes]\n" {
		t.Errorf("escapes and a produced binary file: %q", out)
	}
}

// TestPrintImageNames: an image's MIME type never makes a path.
func TestPrintImageNames(t *testing.T) {
	dir := t.TempDir()
	res := &mcp.CallToolResult{Content: []mcp.Content{
		&mcp.ImageContent{MIMEType: "image/../../evil", Data: []byte("a")},
		&mcp.ImageContent{MIMEType: "image/svg+xml", Data: []byte("b")},
		&mcp.ImageContent{MIMEType: "text/plain", Data: []byte("c")},
	}}
	var out bytes.Buffer
	printResult(&out, res, dir)
	names, _ := filepath.Glob(filepath.Join(dir, "*"))
	for i := range names {
		names[i] = filepath.Base(names[i])
	}
	if got := strings.Join(names, " "); got != "kiln-image-1.bin kiln-image-2.svg+xml kiln-image-3.bin" {
		t.Errorf("saved %s\n%s", got, out.String())
	}
}

// TestHelpGroupsBackendFlags: a serving command's help shows each
// backend's flags under its name, after the command's own; with --backend
// NAME first, only that backend's.
func TestHelpGroupsBackendFlags(t *testing.T) {
	_, _, all := kiln(t, "mcp", "-h")
	jail := strings.Index(all, "\nFlags of the jail backend (--backend jail):\n")
	gv := strings.Index(all, "\nFlags of the gvisor backend (--backend gvisor):\n")
	if jail < 0 || gv < 0 {
		t.Fatalf("kiln mcp -h has no jail and gvisor groups:\n%s", all)
	}
	if z := strings.Index(all, "  -zygote\n"); z < jail || (gv > jail && z > gv) {
		t.Errorf("-zygote is not in the jail's group:\n%s", all)
	}
	if m := strings.Index(all, "  -mode string\n"); m < 0 || m > jail {
		t.Errorf("the command's own -mode is not listed before the backends' groups:\n%s", all)
	}
	_, _, one := kiln(t, "mcp", "--backend", "gvisor", "-h")
	if !strings.Contains(one, "  -runsc string\n") || strings.Contains(one, "-zygote") || !strings.Contains(one, "  -mode string\n") {
		t.Errorf("kiln mcp --backend gvisor -h should show the common flags and gvisor's only:\n%s", one)
	}
}
