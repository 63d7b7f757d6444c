package wasm

import (
	"archive/zip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

// newTestBackend returns the backend on the pinned runtime. Without it the
// tests skip, unless KILN_TEST_WASM=1 (CI), which installs it first.
func newTestBackend(t *testing.T) *Backend { return newTestBackendWith(t, Options{}) }

func newTestBackendWith(t *testing.T, opts Options) *Backend {
	t.Helper()
	if _, err := Installed(""); err != nil {
		if os.Getenv("KILN_TEST_WASM") != "1" {
			t.Skipf("Deno and Pyodide are not installed (%s, or set KILN_TEST_WASM=1 to install them first)", InstallCommand)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		if _, err := Install(ctx, "", nil); err != nil {
			t.Fatalf("installing the wasm runtime: %v", err)
		}
	}
	b, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// conformance is how the shared suite runs on wasm: no shell, and
// Pyodide's heap cap turns a memory bomb into a MemoryError.
var conformance = sandboxtest.Options{
	NoShell: "the wasm backend has none: " + NoShellReason,
	NoOS:    "wasm boxes have none: Python runs in WebAssembly, where libc's syscalls, signals, processes, threads and ctypes into libc do not exist",
	NoPlanEnv: "Python runs in Pyodide, with no agent and no processes to hand the box plan's environment to: os.environ is Emscripten's, " +
		"with HOME and XDG_CACHE_HOME set by the kernel (host/kernel.mjs)",
	Scale: 2,
}

var _ sandboxtest.LeakChecker = (*Backend)(nil)

// TestConformance runs the suite on boxes restored from the memory
// snapshot, TestConformanceCold on boxes that load Pyodide from scratch.
func TestConformance(t *testing.T) {
	sandboxtest.RunWith(t, newTestBackend(t), conformance)
}

func TestConformanceCold(t *testing.T) {
	sandboxtest.RunWith(t, newTestBackendWith(t, Options{Cold: true}), conformance)
}

func newBox(t *testing.T, b *Backend, mem int64) sandbox.Sandbox {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: fmt.Sprintf("t%d-%d", os.Getpid(), time.Now().UnixNano()), Limits: sandbox.Limits{MemoryBytes: mem}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { box.Close() })
	return box
}

func run(t *testing.T, box sandbox.Sandbox, code string) (string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := box.RunPython(ctx, code, sandbox.ExecOptions{})
	if err != nil {
		t.Fatalf("%q: %v", code, err)
	}
	errText := ""
	if res.Error != nil {
		errText = res.Error.Name + ": " + res.Error.Value + "\n" + res.Error.Traceback
	}
	return res.Stdout.Text + res.Result["text/plain"], errText
}

// TestEscapes runs, from Python, what the issue names as the ways out of
// Pyodide into its host, and wants each refused. Asynchronous ones (fetch,
// import()) settle between cells; a second cell reads how.
func TestEscapes(t *testing.T) {
	b := newTestBackend(t)
	secret := filepath.Join(t.TempDir(), "secret")
	canary := fmt.Sprintf("kiln-wasm-canary-%d", time.Now().UnixNano())
	if err := os.WriteFile(secret, []byte(canary), 0o644); err != nil {
		t.Fatal(err)
	}
	var hits atomic.Int64
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			hits.Add(1)
			c.Write([]byte("HTTP/1.0 200 OK\r\n\r\nHOST-SECRET"))
			c.Close()
		}
	}()
	port := l.Addr().(*net.TCPAddr).Port
	t.Setenv("KILN_WASM_SECRET", canary)

	sync := []struct{ name, code string }{
		{"read a host file", fmt.Sprintf("import js\njs.Deno.readTextFileSync(%q)", secret)},
		{"read /etc/passwd", "import js\njs.Deno.readTextFileSync('/etc/passwd')"},
		{"write a host file", fmt.Sprintf("import js\njs.Deno.writeTextFileSync(%q, 'x')", secret+".w")},
		{"the environment", "import js\njs.Deno.env.toObject()"},
		{"one variable", "import js\njs.Deno.env.get('KILN_WASM_SECRET')"},
		{"pyodide_js", "import pyodide_js\npyodide_js.version"},
		{"a subprocess", "import js\njs.Deno.Command.new('/bin/sh', js.JSON.parse('{\"args\": [\"-c\", \"id\"]}')).outputSync()"},
		{"dlopen", "import js\njs.Deno.dlopen('libc.so.6', js.Object.new())"},
		{"a permission request", "import js\nst = js.Deno.permissions.requestSync(js.JSON.parse('{\"name\": \"read\"}'))\nassert st.state == 'granted', st.state"},
		{"a python socket", fmt.Sprintf("import socket\nsocket.create_connection(('127.0.0.1', %d), timeout=2)", port)},
		{"os.system", "import os\nassert os.system('id') == 0"},
		{"posix.system", "import posix\nassert posix.system('id') == 0"},
		{"subprocess", "import subprocess\nsubprocess.run(['id'])"},
	}
	box := newBox(t, b, 0)
	for _, c := range sync {
		t.Run(c.name, func(t *testing.T) {
			out, errText := run(t, box, c.code)
			if errText == "" {
				t.Errorf("not refused: %q", out)
			}
			if strings.Contains(out+errText, canary) || strings.Contains(out+errText, "root:x:0:0") {
				t.Errorf("leaked: %s %s", out, errText)
			}
			t.Logf("refused: %s", strings.SplitN(errText, "\n", 2)[0])
		})
	}

	async := []struct{ name, expr string }{
		{"fetch the host", fmt.Sprintf("js.fetch('http://127.0.0.1:%d/')", port)},
		{"fetch a name", "js.fetch('http://example.com/')"},
		{"a socket", fmt.Sprintf("js.Deno.connect(js.JSON.parse('{\"port\": %d}'))", port)},
		{"fetch a file URL", fmt.Sprintf("js.fetch('file://%s')", secret)},
		{"import a URL", "js.eval(\"import('https://example.com/x.js')\")"},
		{"import a file", fmt.Sprintf("js.eval(\"import('file://%s')\")", secret)},
		{"a worker from a file", fmt.Sprintf("js.eval(\"new Promise((ok, no) => { const w = new Worker('file://%s', {type: 'module'}); w.onerror = (e) => { e.preventDefault(); no(new Error(e.message)); }; setTimeout(() => ok('worker ran'), 3000); })\")", secret)},
	}
	for _, c := range async {
		t.Run(c.name, func(t *testing.T) {
			_, errText := run(t, box, "import js\n_r = {}\n_p = "+c.expr+"\n_p.then(lambda v: _r.__setitem__('ok', str(v)), lambda e: _r.__setitem__('err', str(e)))\nNone")
			if errText != "" {
				t.Logf("refused at once: %s", strings.SplitN(errText, "\n", 2)[0])
				return
			}
			var out string
			for i := 0; i < 400; i++ {
				out, _ = run(t, box, "_r")
				if out != "{}" {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if !strings.Contains(out, "'err'") {
				t.Errorf("not refused: %s", out)
			}
			if strings.Contains(out, canary) || strings.Contains(out, "HOST-SECRET") {
				t.Errorf("leaked: %s", out)
			}
			t.Logf("refused: %s", out)
		})
	}
	if n := hits.Load(); n != 0 {
		t.Errorf("the host listener got %d connections from the box", n)
	}
}

// TestMemory: a bomb in Python's heap is a MemoryError and the box lives
// on; a bomb in JavaScript's heap kills the box (V8's heap cap), and the
// backend still makes boxes.
func TestMemory(t *testing.T) {
	b := newTestBackend(t)
	box := newBox(t, b, 256<<20)
	_, errText := run(t, box, "x = []\nwhile True:\n    x.append(bytearray(16 << 20))")
	if !strings.HasPrefix(errText, "MemoryError") {
		t.Fatalf("python heap bomb: %q", errText)
	}
	if out, _ := run(t, box, "del x\nsum(range(10))"); out != "45" {
		t.Errorf("after the bomb: %q", out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := box.RunPython(ctx, "import js\njs.eval('const a = []; for (;;) a.push(new Array(1e6).fill(1.5))')", sandbox.ExecOptions{})
	switch {
	case err != nil && !errors.Is(err, sandbox.ErrDied):
		t.Fatalf("javascript heap bomb: %v", err)
	case err == nil && res.Error == nil:
		t.Fatalf("javascript heap bomb ran to the end")
	}
	t.Logf("javascript heap bomb: %v", err)
	if out, _ := run(t, newBox(t, b, 256<<20), "6 * 7"); out != "42" {
		t.Errorf("a new box: %q", out)
	}
}

// TestTimeoutKills: a loop in JavaScript ignores Python's interrupt, so at
// the time limit the session layer kills the Deno process and says the
// session restarted; the next call gets a fresh box.
func TestTimeoutKills(t *testing.T) {
	b := newTestBackend(t)
	m := session.NewManager(session.Options{Backend: b, DefaultTimeout: 5 * time.Second, Grace: 2 * time.Second})
	defer m.Close()
	s, err := m.Get("test", "default")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if out, err := s.RunPython(ctx, "kept = 1\nwhile True:\n    pass", 3*time.Second); err != nil || !out.TimedOut || out.Restarted {
		t.Errorf("python loop: %v %+v", err, out)
	}
	out, err := s.RunPython(ctx, "import js\njs.eval('for (;;) {}')", 3*time.Second)
	if err != nil || !out.TimedOut || !out.Restarted || !strings.Contains(out.Note, "restarted") {
		t.Fatalf("javascript loop: %v %+v", err, out)
	}
	out, err = s.RunPython(ctx, "'kept' in dir()", 30*time.Second)
	if err != nil || out.Result["text/plain"] != "False" {
		t.Errorf("after the kill: %v %+v", err, out)
	}
}

// TestKernel: the driver's display behaviour works in Pyodide.
func TestKernel(t *testing.T) {
	b := newTestBackend(t)
	box := newBox(t, b, 0)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := box.RunPython(ctx, "class T:\n    def _repr_html_(self):\n        return '<b>t</b>'\ndisplay(T())\nprint('out')\nimport sys; print('err', file=sys.stderr)\nT()", sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Result["text/html"] != "<b>t</b>" || len(res.Displays) != 1 || res.Stdout.Text != "out\n" || res.Stderr.Text != "err\n" {
		t.Errorf("display: %+v", res)
	}
	res, err = box.RunPython(ctx, "def f():\n    1/0\nf()", sandbox.ExecOptions{})
	if err != nil || res.Error == nil || !strings.Contains(res.Error.Traceback, `File "<cell 2>", line 2, in f`) || strings.Contains(res.Error.Traceback, "kiln-driver") {
		t.Errorf("traceback: %v %+v", err, res.Error)
	}
	res, err = box.RunPython(ctx, "print('x' * 100000)", sandbox.ExecOptions{MaxOutput: 1000})
	if err != nil || res.Stdout.Total != 100001 || len(res.Stdout.Text) != 1000 {
		t.Errorf("cap: %v total %d kept %d", err, res.Stdout.Total, len(res.Stdout.Text))
	}
	if _, err := box.RunShell(ctx, "id", sandbox.ExecOptions{}); err == nil || !strings.Contains(err.Error(), "not available on the wasm backend") {
		t.Errorf("run_shell: %v", err)
	}
}

// TestDenoArgs: a box's Deno is granted nothing but reading its files.
func TestDenoArgs(t *testing.T) {
	b := &Backend{rt: Runtime{Deno: "/x/deno", Pyodide: "/x/pyodide"}, hostDir: "/x/host"}
	args := strings.Join(b.args(b.hostPaths(""), sandbox.Limits{MemoryBytes: 1 << 30}, nil), " ")
	for _, want := range []string{"--no-prompt", "--no-remote", "--no-npm", "--cached-only", "--no-code-cache", "--allow-read=/x/pyodide,/x/host ", "--max-old-space-size=256"} {
		if !strings.Contains(args, want) {
			t.Errorf("deno args lack %q: %s", want, args)
		}
	}
	for _, grant := range []string{"--allow-net", "--allow-env", "--allow-run", "--allow-write", "--allow-ffi", "--allow-all", "-A ", "--allow-import", "--allow-sys"} {
		if strings.Contains(args, grant) {
			t.Errorf("deno args grant %q: %s", grant, args)
		}
	}
}

// TestReseedFromHost keeps the host's reseed list (sandbox.ReseedCode) the
// only one: the box's config carries it, and kernel.mjs runs it and
// redraws no generator of its own.
func TestReseedFromHost(t *testing.T) {
	b := &Backend{rt: Runtime{Deno: "/x/deno", Pyodide: "/x/pyodide"}, hostDir: "/x/host"}
	var cfg config
	for _, a := range b.args(b.hostPaths(""), sandbox.Limits{MemoryBytes: 1 << 30}, nil) {
		if strings.HasPrefix(a, "{") {
			if err := json.Unmarshal([]byte(a), &cfg); err != nil {
				t.Fatal(err)
			}
		}
	}
	if cfg.Reseed != sandbox.ReseedCode {
		t.Errorf("the box's config reseeds %q, want sandbox.ReseedCode", cfg.Reseed)
	}
	if !strings.Contains(kernelScript, `ns.set("_reseed", cfg.reseed || "")`) || !strings.Contains(kernelScript, "\nexec(_reseed, {})\n") {
		t.Error("kernel.mjs does not run the config's reseed code")
	}
	if strings.Contains(kernelScript, ".seed(") {
		t.Error("kernel.mjs reseeds a generator itself: add it to sandbox.ReseedCode instead")
	}
}

// TestBoxPaths: a box's paths (workspace, HOME, XDG_CACHE_HOME) reach
// the kernel from the box plan's package, and the kernel spells none of
// its own.
func TestBoxPaths(t *testing.T) {
	b := &Backend{rt: Runtime{Deno: "/x/deno", Pyodide: "/x/pyodide"}, hostDir: "/x/host"}
	args := b.args(b.hostPaths(""), sandbox.Limits{MemoryBytes: 1 << 30}, nil)
	var cfg config
	if err := json.Unmarshal([]byte(args[len(args)-1]), &cfg); err != nil {
		t.Fatalf("host.mjs's argument: %v", err)
	}
	if cfg.Workspace != boxpolicy.Workspace || cfg.Home != boxpolicy.Home || cfg.Cache != boxpolicy.Cache {
		t.Errorf("paths %q %q %q, want boxpolicy's %q %q %q", cfg.Workspace, cfg.Home, cfg.Cache, boxpolicy.Workspace, boxpolicy.Home, boxpolicy.Cache)
	}
	for _, p := range []string{boxpolicy.Workspace, boxpolicy.Home, boxpolicy.Tmp} {
		if strings.Contains(kernelScript, `"`+p) {
			t.Errorf("kernel.mjs spells %s itself", p)
		}
	}
}

// TestWheels: a pure-Python wheel in the configured directory is
// importable in every box, with no network.
func TestWheels(t *testing.T) {
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "kilnwheel-0.1-py3-none-any.whl"))
	if err != nil {
		t.Fatal(err)
	}
	zw := zip.NewWriter(f)
	for name, body := range map[string]string{
		"kilnwheel/__init__.py":            "def hello():\n    return 'hello from a wheel'\n",
		"kilnwheel-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: kilnwheel\nVersion: 0.1\n",
		"kilnwheel-0.1.dist-info/WHEEL":    "Wheel-Version: 1.0\nGenerator: kiln-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
		"kilnwheel-0.1.dist-info/RECORD":   "",
	} {
		w, _ := zw.Create(name)
		w.Write([]byte(body))
	}
	zw.Close()
	f.Close()
	b := newTestBackendWith(t, Options{Wheels: dir})
	if rt := b.Runtime(); !slices.Contains(rt.Libraries, "kilnwheel") {
		t.Errorf("runtime: %+v", rt)
	}
	out, errText := run(t, newBox(t, b, 0), "import kilnwheel\nkilnwheel.hello()")
	if out != "'hello from a wheel'" {
		t.Errorf("wheel: %q %s", out, errText)
	}
}

// TestNoHostWrites: what code makes Deno load (data: modules, which Deno
// would analyse and cache in DENO_DIR) leaves nothing on the host's disk.
func TestNoHostWrites(t *testing.T) {
	b := newTestBackend(t)
	box := newBox(t, b, 0) // the snapshot exists from here on
	cache, err := CacheDir("")
	if err != nil {
		t.Fatal(err)
	}
	list := func() map[string]int64 {
		m := map[string]int64{}
		filepath.Walk(cache, func(p string, fi os.FileInfo, err error) error {
			if err == nil {
				m[p] = fi.Size()
			}
			return nil
		})
		return m
	}
	before := list()
	_, errText := run(t, box, "import js\njs.eval(\"globalThis.__n = 0; for (let i = 0; i < 200; i++) import('data:text/javascript,export default ' + i + '; // kiln-' + Math.random()).then(() => __n++)\")")
	if errText != "" {
		t.Fatal(errText)
	}
	var out string
	for i := 0; i < 400 && out != "200"; i++ {
		out, _ = run(t, box, "js.__n")
		time.Sleep(20 * time.Millisecond)
	}
	if out != "200" {
		t.Fatalf("the modules did not load: %q", out)
	}
	after := list()
	for p, size := range after {
		if old, ok := before[p]; !ok || old != size {
			t.Errorf("the box wrote %s (%d bytes, was %d)", p, size, old)
		}
	}
	if _, err := os.Stat(b.denoDir); err == nil {
		t.Errorf("DENO_DIR %s exists", b.denoDir)
	}
}
