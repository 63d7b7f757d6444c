package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kiln/internal/sandbox/gvisor"
	"kiln/internal/sandbox/sandboxtest"
)

// TestTemplateGVisor makes a template with kiln template create --backend
// gvisor (the setup runs in a gVisor box whose /template is writable) and
// serves it from a gVisor server through a real MCP client, in per-call
// and session mode: every box has the module and the data file, read-only,
// and the module is imported before a box from the warm-start checkpoint
// is handed out. A jail server refuses the gvisor template, and the
// other way round.
func TestTemplateGVisor(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("gvisor: needs root (runsc creates namespaces and cgroups)")
	}
	if p, err := gvisor.CachedRunscPath(); err != nil || !exists(p) {
		if os.Getenv("KILN_TEST_GVISOR") != "1" {
			t.Skip("gvisor: no runsc in kiln's cache (set KILN_TEST_GVISOR=1 to build the pinned one, about a minute)")
		}
	}
	agent := sandboxtest.BuildAgent(t)
	dir := templateStore(t)
	out, err := makeTemplate(t, agent, dir, "g1", "setup.sh", templateSetupScript, "--import", "tmod", "--backend", "gvisor")
	if err != nil {
		t.Fatalf("kiln template create --backend gvisor: %v", err)
	}
	if !strings.Contains(out, "setup ran as 65534") || !strings.Contains(out, "template g1: 2 files") {
		t.Errorf("kiln template create said:\n%s", out)
	}
	// A setup with --allow-net runs under the template's policy: through
	// the egress gateway, which answers only the allowed name (from a hosts
	// file: nothing is looked up or dialled outside).
	const netSetup = `echo "proxy=${HTTPS_PROXY:-none}"
python3 -c 'import socket
for n in ("example.org", "elsewhere.test"):
    try:
        socket.getaddrinfo(n, 443); print("dns", n, "answered")
    except OSError:
        print("dns", n, "refused")'
`
	hosts := filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(hosts, []byte("93.184.215.14 example.org\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := makeTemplate(t, agent, dir, "g2", "setup.sh", netSetup, "--backend", "gvisor", "--allow-net", "example.org", "--egress-hosts", hosts); err != nil {
		t.Errorf("--allow-net on a gvisor setup: %v\n%s", err, out)
	} else {
		for _, want := range []string{"proxy=http://", "dns example.org answered", "dns elsewhere.test refused"} {
			if !strings.Contains(out, want) {
				t.Errorf("the gvisor setup with --allow-net: missing %q in:\n%s", want, out)
			}
		}
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
			st := startObserved(t, "--backend", "gvisor", "--agent", agent, "--mode", mode, "--template", "g1", "--template-dir", dir, "--preload", "", "--pool", "1")
			defer st.close()
			cs := clientOf(t, st)
			for i := range 2 {
				got := call(t, cs, "run_python", map[string]any{"code": probe})
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
			if mode == "session" && !seen {
				t.Errorf("the session lost its file:\n%s", sh)
			}
			if got := untilPreloaded(t, cs, probe); !strings.Contains(got, "preloaded True") {
				t.Errorf("no box came with tmod imported:\n%s", got)
			}
		})
	}
	if data, _ := os.ReadFile(filepath.Join(dir, "g1", "files", "data.txt")); string(data) != "template data\n" {
		t.Errorf("the template's data.txt is now %q", data)
	}
	var stdout, stderr bytes.Buffer
	if rc := Main([]string{"run", "--agent", agent, "--template-dir", dir, "--preload", "", "--template", "g1", "-c", "1"}, &stdout, &stderr); rc == 0 || !strings.Contains(stderr.String(), "made for the gvisor backend, this server uses jail") {
		t.Errorf("a jail server with a gvisor template (%d): %s", rc, stderr.String())
	}
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
