package config

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// testFlags stands for a command: a few flags of each kind, and two that
// belong to a backend.
type testFlags struct {
	memory  int64
	cpus    float64
	timeout time.Duration
	mode    string
	verbose bool
	zygote  bool
	accel   string
	config  string
}

func newTestFlags(withServe bool) (*flag.FlagSet, *testFlags) {
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	v := &testFlags{}
	fs.Int64Var(&v.memory, "memory", 512, "memory, MiB")
	fs.Float64Var(&v.cpus, "cpus", 1, "cores")
	fs.DurationVar(&v.timeout, "timeout", 30*time.Second, "time limit")
	fs.StringVar(&v.mode, "mode", "session", "mode")
	fs.BoolVar(&v.verbose, "v", false, "debug logs")
	fs.BoolVar(&v.zygote, "zygote", true, "jail: zygote")
	fs.StringVar(&v.accel, "accel", "kvm", "microvm: accel")
	fs.StringVar(&v.config, "config", "", "the file")
	if withServe {
		fs.String("addr", "127.0.0.1:8080", "listen address")
	}
	return fs, v
}

func testLayout() Layout {
	known, _ := newTestFlags(true)
	return Layout{
		Known: known,
		Sections: []Section{
			{Group: "backends", Name: "jail", Flags: []string{"zygote"}},
			{Group: "backends", Name: "microvm", Flags: []string{"accel"}},
		},
		Env:       map[string]string{"memory": "KILN_TEST_MEMORY", "mode": "KILN_TEST_MODE"},
		NotInFile: []string{"config"},
	}
}

func noEnv(string) (string, bool) { return "", false }

func envOf(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestResolveFile(t *testing.T) {
	fs, v := newTestFlags(false)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	const file = `# a comment
memory = 1024
cpus = 2
timeout = "1m"
mode = "per-call"
v = true
addr = "0.0.0.0:9000" # kiln serve's; this command has no such flag

[backends.jail]
zygote = false

[backends.microvm]
accel = "tcg"
`
	vals, err := Resolve(fs, "kiln.toml", []byte(file), testLayout(), noEnv)
	if err != nil {
		t.Fatal(err)
	}
	want := testFlags{memory: 1024, cpus: 2, timeout: time.Minute, mode: "per-call", verbose: true, zygote: false, accel: "tcg"}
	if diff := cmp.Diff(want, *v, cmp.AllowUnexported(testFlags{})); diff != "" {
		t.Errorf("values (-want +got):\n%s", diff)
	}
	for _, name := range []string{"memory", "cpus", "timeout", "mode", "v", "zygote", "accel"} {
		if s := vals.Source(name); s != File {
			t.Errorf("source of %s = %s, want file", name, s)
		}
	}
	if s := vals.Source("config"); s != Default {
		t.Errorf("source of config = %s, want default", s)
	}
}

func TestResolvePrecedence(t *testing.T) {
	fs, v := newTestFlags(false)
	if err := fs.Parse([]string{"--memory", "2048"}); err != nil {
		t.Fatal(err)
	}
	file := "memory = 1024\nmode = \"per-call\"\ncpus = 3\n"
	env := envOf(map[string]string{"KILN_TEST_MEMORY": "4096", "KILN_TEST_MODE": "session"})
	vals, err := Resolve(fs, "kiln.toml", []byte(file), testLayout(), env)
	if err != nil {
		t.Fatal(err)
	}
	// flag > env > file > default
	if v.memory != 2048 || vals.Source("memory") != Flag {
		t.Errorf("memory = %d from %s, want 2048 from the flag", v.memory, vals.Source("memory"))
	}
	if v.mode != "session" || vals.Source("mode") != Env || vals.EnvVars["mode"] != "KILN_TEST_MODE" {
		t.Errorf("mode = %q from %s, want session from KILN_TEST_MODE", v.mode, vals.Source("mode"))
	}
	if v.cpus != 3 || vals.Source("cpus") != File {
		t.Errorf("cpus = %v from %s, want 3 from the file", v.cpus, vals.Source("cpus"))
	}
	if v.timeout != 30*time.Second || vals.Source("timeout") != Default {
		t.Errorf("timeout = %v from %s, want the default", v.timeout, vals.Source("timeout"))
	}
}

// TestResolveErrors: every mistake names the file, the line and the key,
// also in values a flag overrides, and nothing of a refused file is
// applied.
func TestResolveErrors(t *testing.T) {
	tests := []struct {
		name, file string
		args       []string
		want       []string
	}{
		{"unknown key", "memory = 1\n\nmemroy = 2\n", nil, []string{"kiln.toml:3:", `unknown key "memroy"`}},
		{"string for integer", "mode = \"x\"\nmemory = \"1G\"\n", nil, []string{"kiln.toml:2:", "memory", "want an integer", "not a string"}},
		{"float for integer", "memory = 1.5\n", nil, []string{"kiln.toml:1:", "memory", "want an integer"}},
		{"integer for duration", "timeout = 30\n", nil, []string{"kiln.toml:1:", "timeout", `a duration such as "30s"`, "not an integer"}},
		{"bad duration", "\ntimeout = \"30 seconds\"\n", nil, []string{"kiln.toml:2:", "timeout", "invalid value"}},
		{"string for bool", "v = \"yes\"\n", nil, []string{"kiln.toml:1:", "want a boolean"}},
		{"table for string", "[mode]\nx = 1\n", nil, []string{"kiln.toml:1:", "mode", "not a table"}},
		{"array for string", "mode = [\"a\"]\n", nil, []string{"kiln.toml:1:", "not an array"}},
		{"overridden but wrong", "memory = \"lots\"\n", []string{"--memory", "1"}, []string{"kiln.toml:1:", "memory"}},
		{"backend flag at top", "x = 1\nzygote = false\n", nil, []string{"kiln.toml:2:", `"zygote" is a setting of [backends.jail]`}},
		{"unknown backend", "[backends.jial]\nzygote = false\n", nil, []string{"kiln.toml:1:", "unknown table [backends.jial]", "jail, microvm"}},
		{"key of another backend", "[backends.jail]\naccel = \"tcg\"\n", nil, []string{"kiln.toml:2:", `unknown key "accel" in [backends.jail]`}},
		{"backends not a table", "backends = \"jail\"\n", nil, []string{"kiln.toml:1:", `"backends" must be a table`}},
		{"the file's own path", "config = \"/etc/other.toml\"\n", nil, []string{"kiln.toml:1:", `"config" cannot be set in the file`}},
		{"syntax", "memory = 1\ncpus = = 2\n", nil, []string{"kiln.toml:2:"}},
		{"duplicate key", "memory = 1\nmemory = 2\n", nil, []string{"kiln.toml:2:"}},
		{"dotted key", "\n\nmemory.x.y = 1\n", nil, []string{"kiln.toml:3:", "memory: want an integer", "not a table"}},
		{"unknown dotted key", "\nfoo.bar = 1\n", nil, []string{"kiln.toml:2:", `unknown key "foo"`}},
		{"two mistakes", "memroy = 1\ncpus = \"x\"\n", nil, []string{"kiln.toml:1:", "kiln.toml:2:"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs, v := newTestFlags(false)
			if err := fs.Parse(tt.args); err != nil {
				t.Fatal(err)
			}
			before := *v
			_, err := Resolve(fs, "kiln.toml", []byte(tt.file), testLayout(), noEnv)
			if err == nil {
				t.Fatalf("no error for:\n%s", tt.file)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if diff := cmp.Diff(before, *v, cmp.AllowUnexported(testFlags{})); diff != "" {
				t.Errorf("a refused file changed values (-before +after):\n%s", diff)
			}
		})
	}
}

func TestResolveBadEnv(t *testing.T) {
	fs, _ := newTestFlags(false)
	fs.Parse(nil)
	_, err := Resolve(fs, "", nil, testLayout(), envOf(map[string]string{"KILN_TEST_MEMORY": "lots"}))
	if err == nil || !strings.Contains(err.Error(), "KILN_TEST_MEMORY") {
		t.Errorf("err = %v, want one naming KILN_TEST_MEMORY", err)
	}
}

// TestPrintRoundTrip: what Print writes is a file that, read back, gives
// the same values from the file.
func TestPrintRoundTrip(t *testing.T) {
	fs, _ := newTestFlags(true)
	fs.Parse([]string{"--memory", "100", "--timeout", "90s", "--mode", `odd "quoted"` + "\t\x1b", "--cpus", "2", "--accel", "tcg"})
	vals, err := Resolve(fs, "", nil, testLayout(), noEnv)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := Print(&out, fs, vals, testLayout(), "head\n\nline"); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"# head\n#\n# line\n", "memory = 100 # flag --memory\n", `timeout = "1m30s" # flag --timeout`, "cpus = 2.0 # flag", "# zygote = true\n", "[backends.microvm]\n# microvm: accel\naccel = \"tcg\" # flag --accel", "# v = false\n"} {
		if !strings.Contains(out.String(), w) {
			t.Errorf("output lacks %q:\n%s", w, out.String())
		}
	}
	if strings.Contains(out.String(), "config =") {
		t.Errorf("the file's own path is printed as a setting:\n%s", out.String())
	}
	fs2, v2 := newTestFlags(true)
	fs2.Parse(nil)
	vals2, err := Resolve(fs2, "p.toml", out.Bytes(), testLayout(), noEnv)
	if err != nil {
		t.Fatalf("reading back what Print wrote: %v\n%s", err, out.String())
	}
	if v2.memory != 100 || v2.timeout != 90*time.Second || v2.mode != `odd "quoted"`+"\t\x1b" || v2.cpus != 2 || v2.accel != "tcg" || !v2.zygote {
		t.Errorf("read back %+v", *v2)
	}
	if vals2.Source("memory") != File || vals2.Source("zygote") != Default {
		t.Errorf("sources read back: %v", vals2.Sources)
	}
}

func TestReadFile(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "kiln.toml")
	os.WriteFile(good, []byte("memory = 1\n"), 0o644)
	if _, err := ReadFile(good); err != nil {
		t.Errorf("a 0644 file of its user: %v", err)
	}
	for _, mode := range []os.FileMode{0o666, 0o664, 0o646} {
		p := filepath.Join(dir, "w.toml")
		os.WriteFile(p, []byte("agent = \"/tmp/evil\"\n"), 0o600)
		os.Chmod(p, mode)
		if _, err := ReadFile(p); !errors.Is(err, ErrUnsafeFile) {
			t.Errorf("mode %04o: err = %v, want ErrUnsafeFile", mode, err)
		}
	}
	if os.Geteuid() == 0 {
		p := filepath.Join(dir, "other.toml")
		os.WriteFile(p, []byte("memory = 1\n"), 0o644)
		os.Chown(p, 4242, 4242)
		if _, err := ReadFile(p); !errors.Is(err, ErrUnsafeFile) || !strings.Contains(err.Error(), "4242") {
			t.Errorf("file of uid 4242: err = %v, want ErrUnsafeFile naming the uid", err)
		}
	}
	if _, err := ReadFile(dir); err == nil {
		t.Error("a directory was read as a configuration")
	}
	big := filepath.Join(dir, "big.toml")
	os.WriteFile(big, bytes.Repeat([]byte("#\n"), MaxFileSize), 0o600)
	if _, err := ReadFile(big); err == nil || !strings.Contains(err.Error(), "larger") {
		t.Errorf("a %d-byte file: err = %v", 2*MaxFileSize, err)
	}
	if _, err := ReadFile(filepath.Join(dir, "missing.toml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: err = %v", err)
	}
}

func TestFind(t *testing.T) {
	dir := t.TempDir()
	env := envOf(map[string]string{"XDG_CONFIG_HOME": dir, "HOME": "/nonexistent"})
	if got := UserPath(env); got != filepath.Join(dir, "kiln", "kiln.toml") {
		t.Errorf("UserPath = %s", got)
	}
	if got := UserPath(envOf(map[string]string{"XDG_CONFIG_HOME": "rel", "HOME": "/h"})); got != "/h/.config/kiln/kiln.toml" {
		t.Errorf("UserPath with a relative XDG_CONFIG_HOME = %s", got)
	}
	if got := UserPath(envOf(map[string]string{"HOME": "rel"})); got != "" {
		t.Errorf("UserPath without an absolute directory = %q", got)
	}
	if _, err := os.Stat(SystemPath); err == nil {
		t.Skipf("%s exists on this host", SystemPath)
	}
	if got := Find(env); got != "" {
		t.Errorf("Find with no file = %q", got)
	}
	os.MkdirAll(filepath.Join(dir, "kiln"), 0o755)
	os.WriteFile(filepath.Join(dir, "kiln", "kiln.toml"), nil, 0o600)
	if got := Find(env); got != filepath.Join(dir, "kiln", "kiln.toml") {
		t.Errorf("Find = %q", got)
	}
}

// FuzzResolve: no file makes Resolve panic, and a file it accepts sets
// only flags of the layout.
func FuzzResolve(f *testing.F) {
	for _, s := range []string{
		"memory = 1\n[backends.jail]\nzygote = false\n",
		"[[backends]]\nx = 1\n",
		"backends = [{jail = 1}]\n",
		"[backends.jail.zygote]\nx = 1\n",
		"mode = 1979-05-27T07:32:00Z\n",
		"timeout = \"\"\nv = true\ncpus = inf\n",
		"a.b.c = 1\n",
		"memory = 9223372036854775807\ncpus = -0.0\n",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, file string) {
		fs, _ := newTestFlags(false)
		fs.Parse(nil)
		vals, err := Resolve(fs, "f.toml", []byte(file), testLayout(), noEnv)
		if err != nil {
			return
		}
		for name := range vals.Sources {
			if fs.Lookup(name) == nil {
				t.Errorf("source recorded for unknown flag %q", name)
			}
		}
	})
}
