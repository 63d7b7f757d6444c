package cli

import (
	"bytes"
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// cleanConfigEnv keeps the host's environment and files out of a test.
func cleanConfigEnv(t *testing.T) {
	t.Helper()
	for _, k := range []string{"KILN_CONFIG", "KILN_TOKEN"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	fs, err := serveFlags()
	if err != nil {
		t.Fatal(err)
	}
	fs.VisitAll(func(f *flag.Flag) {
		if env := flagEnv(f.Name); f.Name != "config" {
			t.Setenv(env, "")
			os.Unsetenv(env)
		}
	})
}

func configPrint(t *testing.T, args ...string) string {
	t.Helper()
	var out, errOut bytes.Buffer
	if err := runConfig(append([]string{"print"}, args...), &out, &errOut); err != nil {
		t.Fatalf("kiln config print %v: %v\n%s", args, err, errOut.String())
	}
	return out.String()
}

func writeConfig(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kiln.toml")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestExampleConfig: the sample in the repository is what kiln config
// print writes with nothing set, so it lists every setting and default of
// this build and cannot drift. After a change of flags, rewrite it with
// KILN_CONFIG= go run -tags kiln_kubernetes,kiln_oci ./cmd/kiln config print > kiln.example.toml
// (the full build: the sample lists every backend's settings)
func TestExampleConfig(t *testing.T) {
	skipLean(t)
	cleanConfigEnv(t)
	if _, err := os.Stat("/etc/kiln/kiln.toml"); err == nil {
		t.Skip("/etc/kiln/kiln.toml exists on this host; kiln would read it")
	}
	want, err := os.ReadFile("../../kiln.example.toml")
	if err != nil {
		t.Fatal(err)
	}
	got := configPrint(t)
	if diff := cmp.Diff(string(want), got); diff != "" {
		t.Errorf("kiln.example.toml differs from kiln config print (-file +print); rewrite it with\n"+
			"  KILN_CONFIG= go run -tags %s ./cmd/kiln config print > kiln.example.toml\n%s", fullTags, diff)
	}
}

// TestConfigEverySetting: every default the sample shows, uncommented,
// is a valid file that sets every flag — whatever flags the commands
// define, with no code of their own for the file.
func TestConfigEverySetting(t *testing.T) {
	skipLean(t)
	cleanConfigEnv(t)
	sample, err := os.ReadFile("../../kiln.example.toml")
	if err != nil {
		t.Fatal(err)
	}
	setting := regexp.MustCompile(`(?m)^# ([a-z][a-z0-9-]*) = `)
	keys := setting.FindAllStringSubmatch(string(sample), -1)
	if len(keys) < 30 {
		t.Fatalf("only %d settings in the sample", len(keys))
	}
	p := writeConfig(t, setting.ReplaceAllString(string(sample), "$1 = "))
	got := configPrint(t, "--config", p)
	for _, k := range keys {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(k[1]) + ` = .* # file$`).MatchString(got) {
			t.Errorf("%s is not set from the file:\n%s", k[1], got)
		}
	}
	if !strings.Contains(got, "Read from "+p) {
		t.Errorf("the file read is not named")
	}
}

func TestConfigSources(t *testing.T) {
	cleanConfigEnv(t)
	p := writeConfig(t, "memory = 2048\ntimeout = \"2m\"\n\n[backends.jail]\nzygote = false\n")
	t.Setenv("KILN_CONFIG", p)
	t.Setenv("KILN_TOKEN", "s3cret-token-value")
	got := configPrint(t, "--timeout", "45s")
	for _, w := range []string{
		"memory = 2048 # file\n",
		`timeout = "45s" # flag --timeout` + "\n",
		"[backends.jail]",
		"zygote = false # file\n",
		"# mode = \"session\"\n",
		"Read from " + p,
		"KILN_TOKEN (one more bearer token; not shown)",
	} {
		if !strings.Contains(got, w) {
			t.Errorf("missing %q in:\n%s", w, got)
		}
	}
	if strings.Contains(got, "s3cret") {
		t.Errorf("the token's value was printed")
	}
	// --config "" reads no file, KILN_CONFIG or not.
	if got := configPrint(t, "--config", ""); strings.Contains(got, " # file\n") || strings.Contains(got, "Read from") {
		t.Errorf("--config \"\" still read %s:\n%s", p, got)
	}
}

// TestConfigFromEnvironment: KILN_<FLAG> sets any flag, a backend's too,
// over the file and under the command line; a bad value names its
// variable.
func TestConfigFromEnvironment(t *testing.T) {
	cleanConfigEnv(t)
	p := writeConfig(t, "memory = 2048\npool = 3\n")
	t.Setenv("KILN_CONFIG", p)
	t.Setenv("KILN_MEMORY", "768")
	t.Setenv("KILN_MAX_OUTPUT", "30000")
	t.Setenv("KILN_ZYGOTE_MAX_BOXES", "7")
	t.Setenv("KILN_POOL", "5")
	got := configPrint(t, "--pool", "2")
	for _, w := range []string{
		"memory = 768 # env KILN_MEMORY\n",
		"max-output = 30000 # env KILN_MAX_OUTPUT\n",
		"zygote-max-boxes = 7 # env KILN_ZYGOTE_MAX_BOXES\n",
		"pool = 2 # flag --pool\n",
		"KILN_MEMORY (--memory)",
	} {
		if !strings.Contains(got, w) {
			t.Errorf("missing %q in:\n%s", w, got)
		}
	}
	t.Setenv("KILN_MEMORY", "lots")
	var out, errOut bytes.Buffer
	if err := runConfig([]string{"print"}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "KILN_MEMORY") {
		t.Errorf("a bad KILN_MEMORY: err = %v, want it named", err)
	}
}

// TestConfigReachesCommands: the file's values reach the commands, a key
// only kiln serve has is accepted by kiln mcp, and a mistake stops every
// command before it starts anything.
func TestConfigReachesCommands(t *testing.T) {
	cleanConfigEnv(t)
	var out, errOut bytes.Buffer
	p := writeConfig(t, "addr = \"127.0.0.1:9999\"\nmode = \"sometimes\"\n")
	if err := runMCP([]string{"--config", p}, &out, &errOut); err == nil || !strings.Contains(err.Error(), `--mode must be session or per-call, not "sometimes"`) {
		t.Errorf("kiln mcp: err = %v, want the file's mode refused", err)
	}
	if got := configPrint(t, "mcp", "--config", p); !strings.Contains(got, "\nmode = \"sometimes\" # file\n") || regexp.MustCompile(`(?m)^(# )?addr = `).MatchString(got) {
		t.Errorf("kiln config print mcp:\n%s", got)
	}
	bad := writeConfig(t, "memroy = 1\n")
	for name, run := range map[string]func() error{
		"mcp":   func() error { return runMCP([]string{"--config", bad}, &out, &errOut) },
		"serve": func() error { return runServe([]string{"--config", bad}, &errOut) },
		"run": func() error {
			_, err := runOnce([]string{"--config", bad, "-c", "print(1)"}, &out, &errOut)
			return err
		},
	} {
		if err := run(); err == nil || !strings.Contains(err.Error(), bad+":1: unknown key \"memroy\"") {
			t.Errorf("kiln %s: err = %v, want the unknown key with file and line", name, err)
		}
	}
	missing := filepath.Join(t.TempDir(), "none.toml")
	if err := runMCP([]string{"--config", missing}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "none.toml") {
		t.Errorf("a missing --config file: err = %v", err)
	}
}

// TestForeignBackendFlags: a flag of another backend on a server's
// command line is named, with its backend, since it does nothing there;
// one of the server's own backend, or common to all, is not. The same
// flag through the environment is every backend's setting, and is not.
func TestForeignBackendFlags(t *testing.T) {
	cleanConfigEnv(t)
	parse := func(args ...string) []foreignFlag {
		t.Helper()
		fs := flag.NewFlagSet("kiln mcp", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		var c common
		c.register(fs)
		if err := c.parseFlags(fs, args); err != nil {
			t.Fatal(err)
		}
		return c.ignored
	}
	if got := parse("--backend", "jail", "--cluster-tls", "/x", "--memory", "256"); !slices.Equal(got, []foreignFlag{{"cluster-tls", "cluster"}}) {
		t.Errorf("--cluster-tls with the jail: %v, want it named as the cluster's", got)
	}
	if got := parse("--backend", "cluster", "--cluster-tls", "/x", "--memory", "256"); len(got) != 0 {
		t.Errorf("--cluster-tls with the cluster: %v, want nothing", got)
	}
	t.Setenv("KILN_CLUSTER_TLS", "/x")
	if got := parse("--backend", "jail"); len(got) != 0 {
		t.Errorf("KILN_CLUSTER_TLS with the jail: %v, want nothing", got)
	}
}
