package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// templateFiles makes a configured template's files as kiln template
// create leaves them: a module under python/ and a data file, owned by
// root and writable by no one.
func templateFiles(t *testing.T) string { return templateFilesB(t) }

func templateFilesB(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "files")
	if err := os.MkdirAll(filepath.Join(dir, "python"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "python", "tmod.py"), []byte("VALUE = 'from-template'\n"), 0o444)
	os.WriteFile(filepath.Join(dir, "data.txt"), []byte("template data\n"), 0o444)
	for _, d := range []string{filepath.Join(dir, "python"), dir} {
		os.Chmod(d, 0o555)
	}
	return dir
}

const templateProbe = `import sys
print("preloaded", "tmod" in sys.modules)
import tmod
print(tmod.VALUE, open("/template/data.txt").read().strip())
try:
    open("/template/data.txt", "a").write("x"); print("WROTE")
except OSError as e:
    print("write refused", e.errno)
`

// TestTemplate: a box of a backend with a configured template, cold and
// restored from the warm-start checkpoint, sees the template's files
// read-only at /template, imports its module from PYTHONPATH, and (warm)
// has it imported before it is handed out.
func TestTemplate(t *testing.T) {
	files := templateFiles(t)
	for _, cold := range []bool{true, false} {
		name := map[bool]string{true: "cold", false: "warm"}[cold]
		t.Run(name, func(t *testing.T) {
			b := newTestBackend(t, Options{Cold: cold, Template: files})
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			spec := sandbox.Spec{ID: "tpl-" + name, Preload: []string{"tmod"}}
			if !cold {
				if err := b.Warm(ctx, spec); err != nil {
					t.Fatal(err)
				}
			}
			box, err := b.Create(ctx, spec)
			if err != nil {
				t.Fatal(err)
			}
			defer box.Close()
			res, err := box.RunPython(ctx, templateProbe, sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			got := res.Stdout.Text + res.Stderr.Text
			for _, want := range []string{"preloaded True", "from-template template data", "write refused"} {
				if !strings.Contains(got, want) {
					t.Errorf("missing %q in:\n%s", want, got)
				}
			}
			sh, err := box.RunShell(ctx, "touch /template/x; echo $KILN_TEMPLATE_FILES; ls /template", sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			out := sh.Stdout.Text + sh.Stderr.Text
			if !strings.Contains(out, "Read-only file system") && !strings.Contains(out, "Permission denied") {
				t.Errorf("touch in the template was not refused:\n%s", out)
			}
			if !strings.Contains(out, "/template\n") {
				t.Errorf("KILN_TEMPLATE_FILES not set:\n%s", out)
			}
			if _, err := os.Stat(filepath.Join(files, "x")); err == nil {
				t.Error("the box wrote into the template's host directory")
			}
		})
	}
}

// TestTemplateImageRootNeedsMountPoint: an image root without /template
// is refused at start with a message that says so, not at the first box.
func TestTemplateImageRootNeedsMountPoint(t *testing.T) {
	testRunsc(t)
	root := t.TempDir()
	_, err := New(Options{Agent: testAgent(t), Runsc: testRunsc(t), StateDir: t.TempDir(), Rootfs: root, Template: templateFiles(t)})
	if err == nil || !strings.Contains(err.Error(), "has no /template directory") {
		t.Fatalf("New with an image root without /template: %v", err)
	}
}

// BenchmarkCreateTemplate is a per-call box restored from the warm-start
// checkpoint, with and without a configured template (whose module the
// checkpoint imported): what the template's bind costs a box.
func BenchmarkCreateTemplate(b *testing.B) {
	for _, tpl := range []bool{false, true} {
		name := map[bool]string{false: "none", true: "template"}[tpl]
		b.Run(name, func(b *testing.B) {
			opts := Options{}
			spec := sandbox.Spec{}
			if tpl {
				opts.Template = templateFilesB(b)
				spec.Preload = []string{"tmod"}
			}
			be := newTestBackend(b, opts)
			ctx := context.Background()
			if err := be.Warm(ctx, spec); err != nil {
				b.Fatal(err)
			}
			i := 0
			for b.Loop() {
				i++
				spec.ID = fmt.Sprintf("bench-%d", i)
				sb, err := be.Create(ctx, spec)
				if err != nil {
					b.Fatal(err)
				}
				if got := strings.TrimSpace(run(b, sb, "print(2+2)")); got != "4" {
					b.Fatalf("got %q", got)
				}
				if err := sb.Close(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
