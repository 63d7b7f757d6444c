package jail_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// templateDir makes a template's files as kiln template create leaves
// them: a module under python/ and a data file. The directories and files
// are writable by anyone, so only the bind's read-only flag and Landlock
// stand between model code and them.
func templateDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "python"), 0o777); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{
		"python/tmod.py": "VALUE = 'from-template'\n",
		"data.txt":       "template data\n",
	}
	for name, content := range files {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o666); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, 0o666)
	}
	os.Chmod(dir, 0o777)
	os.Chmod(filepath.Join(dir, "python"), 0o777)
	return dir
}

func templateBackend(t *testing.T, dir string, zygote, writable bool) *jail.Backend {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("the jail tests need root (user namespaces with a uid range, cgroups)")
	}
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Zygote: zygote, Template: dir, TemplateWritable: writable})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// TestTemplateReadOnly: every box, forked from the zygote or started
// directly, imports the template's module (preloaded before the box was
// handed out) and reads its data file, and none can change it.
func TestTemplateReadOnly(t *testing.T) {
	for _, zygote := range []bool{true, false} {
		name := "direct"
		if zygote {
			name = "zygote"
		}
		t.Run(name, func(t *testing.T) {
			dir := templateDir(t)
			b := templateBackend(t, dir, zygote, false)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			box, err := b.Create(ctx, sandbox.Spec{ID: "tpl-" + name, Preload: []string{"tmod"}})
			if err != nil {
				t.Fatal(err)
			}
			defer box.Close()
			res, err := box.RunPython(ctx, `import sys
print("preloaded", "tmod" in sys.modules)
import tmod
print(tmod.VALUE)
print(open("/template/data.txt").read().strip())
for p in ["/template/data.txt", "/template/python/tmod.py", "/template/new.txt", "/template/python/evil.py"]:
    try:
        with open(p, "a") as f:
            f.write("pwned")
        print("WROTE", p)
    except OSError as e:
        print("refused", p, e.errno)
`, sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			out := res.Stdout.Text
			for _, want := range []string{"preloaded True", "from-template", "template data"} {
				if !strings.Contains(out, want) {
					t.Errorf("missing %q in:\n%s%s", want, out, res.Stderr.Text)
				}
			}
			if strings.Contains(out, "WROTE") || strings.Count(out, "refused") != 4 {
				t.Errorf("model code changed the template:\n%s%s", out, res.Stderr.Text)
			}
			sh, err := box.RunShell(ctx, "touch /template/x 2>&1; rm -f /template/data.txt 2>&1; mkdir /template/d 2>&1; ls /template", sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if ls := strings.Fields(sh.Stdout.Text); slices.Contains(ls, "x") || slices.Contains(ls, "d") {
				t.Errorf("the shell changed the template:\n%s", sh.Stdout.Text)
			}
			got, _ := os.ReadFile(filepath.Join(dir, "data.txt"))
			if string(got) != "template data\n" {
				t.Errorf("data.txt on the host is now %q", got)
			}
			entries, _ := os.ReadDir(dir)
			if len(entries) != 2 {
				t.Errorf("the template dir holds %d entries, want 2", len(entries))
			}
		})
	}
}

// TestTemplateWritableForSetup: the setup's box writes into the template.
func TestTemplateWritableForSetup(t *testing.T) {
	dir := templateDir(t)
	b := templateBackend(t, dir, true, true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "tpl-setup"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	res, err := box.RunShell(ctx, `echo made > "$KILN_TEMPLATE_FILES/made.txt" && echo "$PYTHONPATH"`, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 0 || strings.TrimSpace(res.Stdout.Text) != "/template/python" {
		t.Fatalf("exit %d: %s%s", res.ExitCode, res.Stdout.Text, res.Stderr.Text)
	}
	if got, err := os.ReadFile(filepath.Join(dir, "made.txt")); err != nil || string(got) != "made\n" {
		t.Errorf("made.txt: %q, %v", got, err)
	}
}

func TestTemplateMissingDir(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the jail tests need root")
	}
	_, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Template: "/nonexistent/kiln-template"})
	if err == nil || !strings.Contains(err.Error(), "template directory") {
		t.Errorf("New with a missing template dir: %v", err)
	}
}

// TestConformanceWithTemplate: boxes with a template bound in, forked
// from the zygote, still pass the whole conformance suite, its hostile
// battery included.
func TestConformanceWithTemplate(t *testing.T) {
	if testing.Short() {
		t.Skip("the conformance suite is long")
	}
	b := templateBackend(t, templateDir(t), true, false)
	sandboxtest.RunWith(t, b, sandboxtest.Options{HostProcesses: true})
}
