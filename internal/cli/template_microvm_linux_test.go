package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kiln/internal/image/imagetest"
	"kiln/internal/sandbox/sandboxtest"
)

// TestTemplateMicroVM makes a template on the jail and serves it from a
// microVM server (TCG) through a real MCP client, per call: every box has
// the module (imported before the VM was saved) and the data file, and
// cannot write there; no box sees another's files. kiln template create
// --backend microvm is refused with a message that says where to make it.
func TestTemplateMicroVM(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root (the jail makes the template)")
	}
	im := imagetest.Image(t) // skips without KILN_IMAGE_TEST=1
	// The server takes the newest image in the user's cache: give it a
	// cache of its own that holds this tree's image.
	cache := t.TempDir()
	if err := os.MkdirAll(filepath.Join(cache, "kiln", "images"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(im.Dir, filepath.Join(cache, "kiln", "images", filepath.Base(im.Dir))); err != nil {
		t.Fatal(err)
	}
	t.Setenv("XDG_CACHE_HOME", cache)

	agent := sandboxtest.BuildAgent(t)
	dir := templateStore(t)
	if out, err := makeTemplate(t, agent, dir, "m1", "setup.sh", templateSetupScript, "--import", "tmod"); err != nil {
		t.Fatalf("kiln template create: %v\n%s", err, out)
	}
	if out, err := makeTemplate(t, agent, dir, "m2", "setup.sh", "true\n", "--backend", "microvm"); err == nil || !strings.Contains(out, "made on the jail for the microvm backend") {
		t.Errorf("kiln template create --backend microvm: %v\n%s", err, out)
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
	st := startObserved(t, "--backend", "microvm", "--accel", "tcg", "--mode", "per-call", "--template", "m1", "--template-dir", dir, "--preload", "", "--pool", "1")
	defer st.close()
	cs := clientOf(t, st)
	for i := range 2 {
		got := call(t, cs, "run_python", map[string]any{"code": probe})
		for _, want := range []string{"preloaded True", "from-template template data", "write refused"} {
			if !strings.Contains(got, want) {
				t.Errorf("call %d: missing %q in:\n%s", i, want, got)
			}
		}
		if strings.Contains(got, "WROTE") {
			t.Errorf("call %d wrote into the template:\n%s", i, got)
		}
	}
	sh := call(t, cs, "run_shell", map[string]any{"command": "touch /template/x; ls /template; ls"})
	if !strings.Contains(sh, "Read-only file system") {
		t.Errorf("touch in the template was not refused:\n%s", sh)
	}
	if strings.Contains(sh, "mine.txt") {
		t.Errorf("a per-call box sees another's file:\n%s", sh)
	}
	if data, _ := os.ReadFile(filepath.Join(dir, "m1", "files", "data.txt")); string(data) != "template data\n" {
		t.Errorf("the template's data.txt is now %q", data)
	}
	var stdout, stderr bytes.Buffer
	if rc := Main([]string{"run", "--backend", "microvm", "--accel", "tcg", "--template-dir", dir, "--preload", "", "--template", "g1", "-c", "1"}, &stdout, &stderr); rc == 0 || !strings.Contains(stderr.String(), `template "g1"`) {
		t.Errorf("an unknown template on microvm (%d): %s", rc, stderr.String())
	}
}
