package microvm_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kiln/internal/image"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/microvm"
)

// tplFiles makes a configured template's files: a module under python/
// and two data files, one writable by everyone (with the directory), so
// that only the read-only mount can refuse the box's writes.
func tplFiles(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "files")
	if err := os.MkdirAll(filepath.Join(dir, "python"), 0o755); err != nil {
		t.Fatal(err)
	}
	for p, s := range map[string]string{"python/tmod.py": "VALUE = 'from-template'\n", "data.txt": "template data\n", "open.txt": "open\n"} {
		if err := os.WriteFile(filepath.Join(dir, p), []byte(s), 0o444); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(filepath.Join(dir, "open.txt"), 0o666)
	os.Chmod(dir, 0o777)
	return dir
}

const tplProbe = `import sys
print("preloaded", "tmod" in sys.modules)
import tmod
print(tmod.VALUE, open("/template/data.txt").read().strip())
try:
    open("/template/open.txt", "a").write("x"); print("WROTE")
except OSError as e:
    print("write refused", e.errno)
for line in open("/proc/mounts"):
    f = line.split()
    if f[1] == "/template":
        print("mount", f[2], sorted(set(f[3].split(",")) & {"ro", "nosuid", "nodev"}))
`

// TestTemplate: a VM of a backend with a configured template, cold booted
// and cloned from the saved VM, sees the template's files at /template on
// a read-only, nosuid, nodev mount, imports its module from PYTHONPATH
// (a clone has it imported already: it was imported before the VM was
// saved), cannot write there even to a file everyone may write, and the
// host's files stay as they were.
func TestTemplate(t *testing.T) {
	files := tplFiles(t)
	for _, cold := range []bool{true, false} {
		name := map[bool]string{true: "cold", false: "clone"}[cold]
		t.Run(name, func(t *testing.T) {
			b := newBackend(t, microvm.Options{ColdBoot: cold, Template: files})
			ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
			defer cancel()
			box, err := b.Create(ctx, sandbox.Spec{ID: "tpl-" + name, Preload: []string{"tmod"}})
			if err != nil {
				t.Fatal(err)
			}
			defer box.Close()
			res, err := box.RunPython(ctx, tplProbe, sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			got := res.Stdout.Text + res.Stderr.Text
			for _, want := range []string{"preloaded True", "from-template template data", "write refused 30", "mount ext4 ['nodev', 'nosuid', 'ro']"} {
				if !strings.Contains(got, want) {
					t.Errorf("missing %q in:\n%s", want, got)
				}
			}
			sh, err := box.RunShell(ctx, "touch /template/x; echo $KILN_TEMPLATE_FILES; ls /template", sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			out := sh.Stdout.Text + sh.Stderr.Text
			if !strings.Contains(out, "Read-only file system") {
				t.Errorf("touch in the template was not refused:\n%s", out)
			}
			if !strings.Contains(out, "/template\n") || !strings.Contains(out, "data.txt") {
				t.Errorf("KILN_TEMPLATE_FILES or the files missing:\n%s", out)
			}
			if b, err := os.ReadFile(filepath.Join(files, "open.txt")); err != nil || string(b) != "open\n" {
				t.Errorf("the host's template file changed: %q %v", b, err)
			}
			if _, err := os.Stat(filepath.Join(files, "x")); err == nil {
				t.Error("the box wrote into the template's host directory")
			}
		})
	}
}

// TestTemplateMissingDir: a template directory that is not there is
// refused at New, with a message that says so.
func TestTemplateMissingDir(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("needs qemu-system-x86_64")
	}
	_, err := microvm.New(microvm.Options{Image: &image.Image{}, Template: filepath.Join(t.TempDir(), "nope"), StateDir: t.TempDir(), NoCgroup: true})
	if err == nil || !strings.Contains(err.Error(), "template directory") {
		t.Fatalf("New with a missing template: %v", err)
	}
}
