package cli

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// Finding 8 of issue 11: `kiln install --write` could destroy a client's
// config. Each case writes a config, merges the kiln entry into it and
// checks what is on disk afterwards.
func TestMergeDesktopConfig(t *testing.T) {
	entry := map[string]any{"command": "/opt/kiln/bin/kiln", "args": []string{"mcp"}}
	const kept = `{
  "zeta": 12345678901234567890,
  "alpha": {"ratio": 1.50, "tiny": 1e-400, "huge": 1e400, "s": "x\u00e9<>&"},
  "mcpServers": {
    "other": {"command": "/usr/bin/other", "args": ["--port", "8080"], "env": {"ID": 98765432109876543210}},
    "kiln": {"command": "/old/kiln"}
  },
  "list": [1, 2.0, 3e2]
}`
	tests := []struct {
		name    string
		old     *string // nil: no file
		wantErr string  // "" means success
		check   func(t *testing.T, got string)
	}{
		{name: "no file", check: func(t *testing.T, got string) {
			wantEntry(t, got, nil)
		}},
		{name: "null", old: ptr("null"), wantErr: "not a JSON object"},
		{name: "array", old: ptr(`[{"mcpServers": {}}]`), wantErr: "not a JSON object"},
		{name: "string", old: ptr(`"x"`), wantErr: "not a JSON object"},
		{name: "servers array", old: ptr(`{"mcpServers": [{"command": "a"}], "x": 1}`), wantErr: `"mcpServers" is an array, not an object`},
		{name: "servers string", old: ptr(`{"mcpServers": "other", "x": 1}`), wantErr: `"mcpServers" is a string, not an object`},
		{name: "servers null", old: ptr(`{"mcpServers": null}`), wantErr: `"mcpServers" is null, not an object`},
		{name: "not JSON", old: ptr(`{"mcpServers": {`), wantErr: "not valid JSON"},
		{name: "trailing data", old: ptr(`{"mcpServers": {}} {"x": 1}`), wantErr: "not valid JSON"},
		{name: "duplicate servers", old: ptr(`{"mcpServers": {}, "mcpServers": {"a": {}}}`), wantErr: `"mcpServers" twice`},
		{name: "empty file", old: ptr(" \n"), check: func(t *testing.T, got string) {
			wantEntry(t, got, nil)
		}},
		{name: "no servers", old: ptr(`{"theme": "dark", "n": 12345678901234567890}`), check: func(t *testing.T, got string) {
			wantEntry(t, got, nil)
			wantIn(t, got, `"theme": "dark"`, `"n": 12345678901234567890`)
		}},
		{name: "keeps everything else", old: ptr(kept), check: func(t *testing.T, got string) {
			wantEntry(t, got, []string{"other"})
			// Values as written: no float64 on the way.
			wantIn(t, got, `"zeta": 12345678901234567890`, `"ratio": 1.50`, `"tiny": 1e-400`, `"huge": 1e400`,
				`"ID": 98765432109876543210`, `"s": "x\u00e9<>&"`, `2.0`, `3e2`, `"8080"`)
			// And in their order.
			if z, a, l := strings.Index(got, `"zeta"`), strings.Index(got, `"alpha"`), strings.Index(got, `"list"`); !(z < a && a < l) {
				t.Errorf("keys reordered:\n%s", got)
			}
			if strings.Contains(got, "/old/kiln") {
				t.Errorf("old kiln entry kept:\n%s", got)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "Claude", "claude_desktop_config.json")
			if tt.old != nil {
				os.MkdirAll(filepath.Dir(path), 0o755)
				if err := os.WriteFile(path, []byte(*tt.old), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			var backup string
			err := func() (err error) {
				defer func() {
					if r := recover(); r != nil {
						t.Fatalf("panic: %v", r)
					}
				}()
				_, backup, err = mergeEntry(path, "mcpServers", entry, false)
				return err
			}()
			got, _ := os.ReadFile(path)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to say %q; file now:\n%s", err, tt.wantErr, got)
				}
				if string(got) != *tt.old {
					t.Errorf("refused config was changed:\n%s", got)
				}
				noLeftovers(t, filepath.Dir(path), "claude_desktop_config.json")
				return
			}
			if err != nil {
				t.Fatalf("merge: %v", err)
			}
			tt.check(t, string(got))
			st, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if runtime.GOOS != "windows" && st.Mode().Perm() != 0o600 {
				t.Errorf("config mode %v, want 0600", st.Mode().Perm())
			}
			if tt.old != nil {
				// The old file is kept, byte for byte, as a backup.
				bak, err := os.ReadFile(backup)
				if err != nil || string(bak) != *tt.old || !strings.HasPrefix(backup, path+".bak-") {
					t.Errorf("backup %s: %v %q, want the old file", backup, err, bak)
				}
				noLeftovers(t, filepath.Dir(path), "claude_desktop_config.json", filepath.Base(backup))
			} else {
				noLeftovers(t, filepath.Dir(path), "claude_desktop_config.json")
			}
		})
	}
}

// TestMergeDesktopConfigAtomic: the new config replaces the old one by a
// rename, so a reader never sees a half-written file; one that opened the
// old file keeps reading the old content.
func TestMergeDesktopConfigAtomic(t *testing.T) {
	path := filepath.Join(t.TempDir(), "claude_desktop_config.json")
	old := `{"mcpServers": {"other": {"command": "o"}}}`
	os.WriteFile(path, []byte(old), 0o600)
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, _, err := mergeEntry(path, "mcpServers", map[string]any{"command": "k"}, false); err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(f)
	if string(b) != old {
		t.Errorf("the old file was rewritten in place; an open reader now sees:\n%s", b)
	}
}

// TestMergeDesktopConfigSymlink: a symlink at the config path is not
// written through.
func TestMergeDesktopConfigSymlink(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "elsewhere.json")
	os.WriteFile(target, []byte(`{"mcpServers": {}}`), 0o644)
	path := filepath.Join(dir, "claude_desktop_config.json")
	if err := os.Symlink(target, path); err != nil {
		t.Skipf("cannot make a symlink: %v", err)
	}
	_, _, err := mergeEntry(path, "mcpServers", map[string]any{"command": "k"}, false)
	if err == nil || !strings.Contains(err.Error(), "symbolic link") {
		t.Errorf("err = %v, want a refusal that names the symbolic link", err)
	}
	if b, _ := os.ReadFile(target); string(b) != `{"mcpServers": {}}` {
		t.Errorf("symlink target written:\n%s", b)
	}
	if fi, err := os.Lstat(path); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("symlink replaced: %v %v", fi, err)
	}
}

// TestInstallWithoutHome: with HOME unset kiln does not guess a home
// directory (it wrote relative to the current directory).
func TestInstallWithoutHome(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("the config path comes from APPDATA on Windows")
	}
	for _, home := range []string{"", "relative/home"} {
		t.Run("HOME="+home, func(t *testing.T) {
			cwd := t.TempDir()
			t.Chdir(cwd)
			t.Setenv("HOME", home)
			var out, errOut bytes.Buffer
			err := runInstall([]string{"--write", "claude-desktop"}, &out, &errOut)
			if err == nil || !strings.Contains(err.Error(), "HOME") {
				t.Errorf("err = %v, want a refusal that names HOME", err)
			}
			if ents, _ := os.ReadDir(cwd); len(ents) != 0 {
				t.Errorf("wrote under the current directory: %v", ents)
			}
		})
	}
}

func ptr(s string) *string { return &s }

func wantIn(t *testing.T, got string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(got, w) {
			t.Errorf("missing %s in:\n%s", w, got)
		}
	}
}

// wantEntry checks that got holds the kiln entry and exactly the other
// servers named.
func wantEntry(t *testing.T, got string, others []string) {
	t.Helper()
	var cfg struct {
		MCPServers map[string]struct {
			Command string   `json:"command"`
			Args    []string `json:"args"`
		} `json:"mcpServers"`
	}
	if err := json.Unmarshal([]byte(got), &cfg); err != nil {
		t.Fatalf("result is not JSON: %v\n%s", err, got)
	}
	k := cfg.MCPServers["kiln"]
	if k.Command != "/opt/kiln/bin/kiln" || len(k.Args) != 1 || k.Args[0] != "mcp" {
		t.Errorf("kiln entry = %+v in:\n%s", k, got)
	}
	if len(cfg.MCPServers) != len(others)+1 {
		t.Errorf("servers = %v, want kiln and %v", cfg.MCPServers, others)
	}
	for _, o := range others {
		if _, ok := cfg.MCPServers[o]; !ok {
			t.Errorf("server %q dropped:\n%s", o, got)
		}
	}
}

// noLeftovers checks that dir holds only the named files.
func noLeftovers(t *testing.T, dir string, names ...string) {
	t.Helper()
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		found := false
		for _, n := range names {
			found = found || e.Name() == n
		}
		if !found {
			t.Errorf("left behind in %s: %s", dir, e.Name())
		}
	}
}

// Under sudo, install writes nothing: the entry would be the user's, the
// file root's.
func TestInstallUnderSudo(t *testing.T) {
	for _, tc := range []struct {
		uid   int
		sudo  string
		write bool
		fails bool
	}{
		{0, "alice", true, true},
		{0, "alice", false, false}, // printing is harmless
		{0, "", true, false},       // root's own client
		{1000, "", true, false},
	} {
		err := checkInstallUser(tc.uid, tc.sudo, tc.write)
		if (err != nil) != tc.fails {
			t.Errorf("checkInstallUser(%d, %q, %v) = %v, want failure %v", tc.uid, tc.sudo, tc.write, err, tc.fails)
		}
		if err != nil && !strings.Contains(err.Error(), "without sudo") {
			t.Errorf("error %q does not say what to do", err)
		}
	}
}
