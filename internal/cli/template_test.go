package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/config"
	"kiln/internal/mcpserver"
	"kiln/internal/sandbox/sandboxtest"
)

// templateStore is a template directory boxes can reach (every directory
// above it open to other users, as kiln template create requires).
func templateStore(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "templates")
	for d := filepath.Dir(dir); d != "/tmp" && d != "/"; d = filepath.Dir(d) {
		os.Chmod(d, 0o755)
	}
	return dir
}

const templateSetupScript = `set -e
mkdir -p "$KILN_TEMPLATE_FILES/python"
echo 'VALUE = "from-template"' > "$KILN_TEMPLATE_FILES/python/tmod.py"
echo "template data" > "$KILN_TEMPLATE_FILES/data.txt"
echo "setup ran as $(id -u)"
`

// makeTemplate runs kiln template create NAME with setup (a .sh or .py
// file's content) and extra flags.
func makeTemplate(t *testing.T, agent, dir, name, file, setup string, flags ...string) (string, error) {
	t.Helper()
	p := filepath.Join(t.TempDir(), file)
	if err := os.WriteFile(p, []byte(setup), 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	args := append([]string{"template", "create", name, "--template-dir", dir, "--agent", agent, "--setup", p}, flags...)
	rc := Main(args, &stdout, &stderr)
	out := stdout.String() + stderr.String()
	if rc != 0 {
		return out, errorString(out)
	}
	return out, nil
}

type errorString string

func (e errorString) Error() string { return string(e) }

// clientOf connects one MCP client to st's server over the in-memory
// transport.
func clientOf(t *testing.T, st *stack) *mcp.ClientSession {
	t.Helper()
	ctx := context.Background()
	ct, stt := mcp.NewInMemoryTransports()
	ss, err := st.srv.MCP().Connect(ctx, stt, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "template-test", Version: mcpserver.Version}, nil).Connect(ctx, ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// call runs a tool and returns its text.
func call(t *testing.T, cs *mcp.ClientSession, tool string, args map[string]any) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text + "\n")
		}
	}
	if res.StructuredContent != nil {
		raw, _ := json.Marshal(res.StructuredContent)
		b.Write(raw)
	}
	return b.String()
}

// TestTemplateThroughAClient makes a template with kiln template create,
// then serves from it in per-call and session mode, through a real MCP
// client: the module (imported before the box was handed out) and the
// data file are there in every box, the template cannot be changed, and
// no per-call box sees another's files.
func TestTemplateThroughAClient(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the jail needs root (user namespaces with a uid range, cgroups)")
	}
	agent := sandboxtest.BuildAgent(t)
	dir := templateStore(t)
	out, err := makeTemplate(t, agent, dir, "t1", "setup.sh", templateSetupScript, "--import", "tmod")
	if err != nil {
		t.Fatalf("kiln template create: %v", err)
	}
	if !strings.Contains(out, "setup ran as 1000") || !strings.Contains(out, "template t1: 2 files") {
		t.Errorf("kiln template create said:\n%s", out)
	}
	var list bytes.Buffer
	if rc := Main([]string{"template", "list", "--template-dir", dir}, &list, &list); rc != 0 || !strings.Contains(list.String(), "t1") || !strings.Contains(list.String(), "tmod") {
		t.Errorf("kiln template list (%d):\n%s", rc, list.String())
	}

	const probe = `import sys
print("preloaded", "tmod" in sys.modules)
import tmod
print(tmod.VALUE, open("/template/data.txt").read().strip())
try:
    open("/template/data.txt", "a").write("x"); print("WROTE")
except OSError as e:
    print("write refused", e.errno)
open("mine.txt", "w").write("mine")
`
	for _, mode := range []string{"per-call", "session"} {
		t.Run(mode, func(t *testing.T) {
			st := startObserved(t, "--agent", agent, "--mode", mode, "--template", "t1", "--template-dir", dir, "--preload", "", "--pool", "1")
			defer st.close()
			cs := clientOf(t, st)
			for i := range 2 {
				got := call(t, cs, "run_python", map[string]any{"code": probe})
				// The first boxes may start before the template's
				// modules are imported (sandbox.Spec.Urgent): only
				// their files are certain; the per-call case below
				// waits for a preloaded one.
				for _, want := range []string{"from-template template data", "write refused"} {
					if !strings.Contains(got, want) {
						t.Errorf("call %d: missing %q in:\n%s", i, want, got)
					}
				}
				if strings.Contains(got, "WROTE") {
					t.Errorf("call %d wrote into the template:\n%s", i, got)
				}
			}
			sh := call(t, cs, "run_shell", map[string]any{"command": "touch /template/x; ls /template; ls"})
			if !strings.Contains(sh, "Read-only file system") && !strings.Contains(sh, "Permission denied") {
				t.Errorf("touch in the template was not refused:\n%s", sh)
			}
			seen := strings.Contains(sh, "mine.txt")
			if mode == "per-call" && seen {
				t.Errorf("a per-call box sees another's file:\n%s", sh)
			}
			if mode == "per-call" {
				if got := untilPreloaded(t, cs, probe); !strings.Contains(got, "preloaded True") {
					t.Errorf("no box came from the template with tmod imported:\n%s", got)
				}
			}
			if mode == "session" && !seen {
				t.Errorf("the session lost its file:\n%s", sh)
			}
		})
	}
	if data, _ := os.ReadFile(filepath.Join(dir, "t1", "files", "data.txt")); string(data) != "template data\n" {
		t.Errorf("the template's data.txt is now %q", data)
	}

	// Refusals: unknown template, another kiln's, another backend.
	runWith := func(args ...string) string {
		var stdout, stderr bytes.Buffer
		if rc := Main(append([]string{"run", "--agent", agent, "--template-dir", dir, "--preload", "", "-c", "1"}, args...), &stdout, &stderr); rc == 0 {
			t.Errorf("kiln run %v worked", args)
		}
		return stderr.String()
	}
	if msg := runWith("--template", "nope"); !strings.Contains(msg, `template "nope": no such template`) {
		t.Errorf("unknown template: %s", msg)
	}
	if msg := runWith("--template", "t1", "--backend", "gvisor"); !strings.Contains(msg, "made for the jail backend, this server uses gvisor") {
		t.Errorf("gvisor: %s", msg)
	}
	if msg := runWith("--template", "t1", "--backend", "wasm"); !strings.Contains(msg, "not supported on the wasm backend") {
		t.Errorf("wasm: %s", msg)
	}
	mpath := filepath.Join(dir, "t1", "manifest.json")
	raw, _ := os.ReadFile(mpath)
	os.WriteFile(mpath, bytes.Replace(raw, []byte(`"kiln_version": "`+mcpserver.Version+`"`), []byte(`"kiln_version": "0.0.0-old"`), 1), 0o644)
	if msg := runWith("--template", "t1"); !strings.Contains(msg, "made with kiln 0.0.0-old, this is kiln "+mcpserver.Version) {
		t.Errorf("another kiln's template: %s", msg)
	}
	os.WriteFile(mpath, raw, 0o644)

	// A failing setup keeps nothing; a name in use is refused; rm removes.
	if out, err := makeTemplate(t, agent, dir, "bad", "setup.py", "import sys\nprint('half done')\nsys.exit(3)\n"); err == nil || !strings.Contains(out, "exit 3") || !strings.Contains(out, "half done") {
		t.Errorf("a failing setup: %v\n%s", err, out)
	}
	if out, err := makeTemplate(t, agent, dir, "noimp", "setup.sh", "true\n", "--import", "json,kiln_no_such_module"); err == nil || !strings.Contains(out, "--import kiln_no_such_module: the template's boxes cannot import it (ModuleNotFoundError") {
		t.Errorf("an --import the setup did not provide: %v\n%s", err, out)
	}
	if out, err := makeTemplate(t, agent, dir, "badimp", "setup.sh", "true\n", "--import", "os; import sys"); err == nil || !strings.Contains(out, "not a Python module name") {
		t.Errorf("an --import that is code: %v\n%s", err, out)
	}
	if out, err := makeTemplate(t, agent, dir, "t1", "setup.sh", "true\n"); err == nil || !strings.Contains(out, "exists") {
		t.Errorf("a second t1: %v\n%s", err, out)
	}
	var rm bytes.Buffer
	if rc := Main([]string{"template", "rm", "t1", "--template-dir", dir}, &rm, &rm); rc != 0 {
		t.Errorf("kiln template rm: %s", rm.String())
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("left in the template dir: %v", entries)
	}
}

// untilPreloaded runs code (which prints "preloaded True" or "preloaded
// False") in fresh per-call boxes until one comes from the ready zygote
// template with the modules imported, or a minute passes; it returns the
// last output.
func untilPreloaded(t *testing.T, cs *mcp.ClientSession, code string) string {
	t.Helper()
	got := call(t, cs, "run_python", map[string]any{"code": code})
	for i := 0; i < 120 && strings.Contains(got, "preloaded False"); i++ {
		time.Sleep(500 * time.Millisecond)
		got = call(t, cs, "run_python", map[string]any{"code": code})
	}
	return got
}

// TestSetupFileTrusted: the setup's files are sealed into every box served
// with the template, so the setup file is checked as the configuration
// file is: one its group or others can write, or of another user, is
// refused before any box starts.
func TestSetupFileTrusted(t *testing.T) {
	write := func(mode os.FileMode, uid int) string {
		t.Helper()
		p := filepath.Join(t.TempDir(), "setup.py")
		if err := os.WriteFile(p, []byte("print('setup')\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, mode)
		if uid >= 0 {
			if err := os.Chown(p, uid, uid); err != nil {
				t.Fatal(err)
			}
		}
		return p
	}
	if _, err := readSetup(write(0o644, -1)); err != nil {
		t.Fatalf("a 0644 setup file of kiln's user: %v", err)
	}
	if _, err := readSetup(write(0o666, -1)); !errors.Is(err, config.ErrUnsafeFile) {
		t.Errorf("a 0666 setup file: err = %v, want ErrUnsafeFile", err)
	}
	if os.Geteuid() != 0 {
		t.Skip("giving a file to another uid needs root")
	}
	if _, err := readSetup(write(0o644, 4242)); !errors.Is(err, config.ErrUnsafeFile) || !strings.Contains(err.Error(), "uid 4242") {
		t.Errorf("a setup file of uid 4242: err = %v, want ErrUnsafeFile naming the uid", err)
	}
}

// TestTemplateDirFromConfig: the template commands find their directory
// where the serving commands do, through the configuration layer: the
// command line, else KILN_TEMPLATE_DIR, else the file's template-dir.
func TestTemplateDirFromConfig(t *testing.T) {
	list := func() {
		t.Helper()
		var out, errs strings.Builder
		if err := runTemplateList(nil, &out, &errs); err != nil {
			t.Fatalf("kiln template list: %v\n%s", err, errs.String())
		}
	}
	made := func(dir string) bool {
		_, err := os.Stat(dir)
		return err == nil
	}
	cleanConfigEnv(t)
	fromFile := templateStore(t)
	t.Setenv("KILN_CONFIG", writeConfig(t, "template-dir = "+strconv.Quote(fromFile)+"\n"))
	list()
	if !made(fromFile) {
		t.Errorf("kiln template list did not open the file's template-dir %s", fromFile)
	}
	fromEnv := templateStore(t)
	t.Setenv("KILN_TEMPLATE_DIR", fromEnv)
	list()
	if !made(fromEnv) {
		t.Errorf("kiln template list did not open $KILN_TEMPLATE_DIR %s", fromEnv)
	}
}
