package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestInstallClients runs kiln install for every client and scope against
// a config that already holds another server and keys kiln does not know.
func TestInstallClients(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the paths checked are Linux's")
	}
	tests := []struct {
		client, scope string
		rel           string // the config's path under home or the project
		inProject     bool
		serversKey    string
		stdioType     bool
	}{
		{client: "claude-desktop", rel: ".config/Claude/claude_desktop_config.json", serversKey: "mcpServers"},
		{client: "claude-code", rel: ".mcp.json", inProject: true, serversKey: "mcpServers"},
		{client: "cursor", rel: ".cursor/mcp.json", serversKey: "mcpServers"},
		{client: "cursor", scope: "project", rel: ".cursor/mcp.json", inProject: true, serversKey: "mcpServers"},
		{client: "vscode", rel: ".vscode/mcp.json", inProject: true, serversKey: "servers", stdioType: true},
		{client: "vscode", scope: "user", rel: ".config/Code/User/mcp.json", serversKey: "servers", stdioType: true},
	}
	for _, tt := range tests {
		t.Run(tt.client+"/"+tt.scope, func(t *testing.T) {
			home, project := t.TempDir(), t.TempDir()
			t.Setenv("HOME", home)
			t.Setenv("XDG_CONFIG_HOME", "")
			t.Chdir(project)
			path := filepath.Join(home, tt.rel)
			if tt.inProject {
				path = filepath.Join(project, tt.rel)
			}
			old := `{
  "inputs": [{"type": "promptString", "id": "key", "password": true}],
  "` + tt.serversKey + `": {
    "other": {"type": "stdio", "command": "/usr/bin/other", "args": ["--port", "8080"], "env": {"TOKEN": "keep-me"}},
    "kiln": {"command": "/old/kiln"}
  },
  "unknownSetting": {"nested": [1, 2.50, 12345678901234567890]}
}
`
			os.MkdirAll(filepath.Dir(path), 0o755)
			if err := os.WriteFile(path, []byte(old), 0o644); err != nil {
				t.Fatal(err)
			}
			args := []string{tt.client}
			if tt.scope != "" {
				args = append(args, "--scope", tt.scope)
			}

			// The default prints and writes nothing.
			var out, errOut bytes.Buffer
			if err := runInstall(args, &out, &errOut); err != nil {
				t.Fatalf("kiln install %v: %v", args, err)
			}
			if b, _ := os.ReadFile(path); string(b) != old {
				t.Fatalf("printing changed %s:\n%s", path, b)
			}
			wantIn(t, out.String(), path, `"`+tt.serversKey+`"`, `"kiln"`)

			out.Reset()
			if err := runInstall(append(args, "--write", "--config", "rel/kiln.toml"), &out, &errOut); err != nil {
				t.Fatalf("kiln install %v --write: %v", args, err)
			}
			got, _ := os.ReadFile(path)
			var cfg map[string]json.RawMessage
			if err := json.Unmarshal(got, &cfg); err != nil {
				t.Fatalf("result is not JSON: %v\n%s", err, got)
			}
			var servers map[string]map[string]any
			if err := json.Unmarshal(cfg[tt.serversKey], &servers); err != nil {
				t.Fatalf("%s: %v\n%s", tt.serversKey, err, got)
			}
			k := servers["kiln"]
			cmd, _ := k["command"].(string)
			if !filepath.IsAbs(cmd) {
				t.Errorf("command %q is not absolute", cmd)
			}
			wantArgs := []any{"mcp", "--config", filepath.Join(project, "rel/kiln.toml")}
			if a, _ := json.Marshal(k["args"]); string(a) != mustJSON(wantArgs) {
				t.Errorf("args = %s, want %s", a, mustJSON(wantArgs))
			}
			if typ, has := k["type"]; tt.stdioType != has || (has && typ != "stdio") {
				t.Errorf("type = %v (present %v), want stdio: %v", typ, has, tt.stdioType)
			}
			if len(servers) != 2 || servers["other"]["command"] != "/usr/bin/other" {
				t.Errorf("other servers not kept: %v", servers)
			}
			wantIn(t, string(got), `"TOKEN": "keep-me"`, `"unknownSetting"`, `12345678901234567890`, `2.50`, `"password": true`)
			if strings.Contains(string(got), "/old/kiln") {
				t.Errorf("old kiln entry kept:\n%s", got)
			}
			baks, _ := filepath.Glob(path + ".bak-*")
			if len(baks) != 1 {
				t.Fatalf("backups: %v, want one", baks)
			}
			if b, _ := os.ReadFile(baks[0]); string(b) != old {
				t.Errorf("backup %s is not the old file:\n%s", baks[0], b)
			}
			wantIn(t, out.String(), path, baks[0])

			// Again: nothing to change, so no write and no second backup.
			out.Reset()
			if err := runInstall(append(args, "--write", "--config", "rel/kiln.toml"), &out, &errOut); err != nil {
				t.Fatal(err)
			}
			wantIn(t, out.String(), "nothing changed")
			if again, _ := os.ReadFile(path); string(again) != string(got) {
				t.Errorf("an unchanged entry rewrote the file")
			}
			if baks, _ := filepath.Glob(path + ".bak-*"); len(baks) != 1 {
				t.Errorf("backups after a no-op: %v", baks)
			}
		})
	}
}

// TestInstallRefusesBrokenConfig: a config that does not parse is left as
// it is, with no backup and a clear error; so is JSON with comments (VS
// Code's files may have them), which kiln cannot keep.
func TestInstallRefusesBrokenConfig(t *testing.T) {
	for name, content := range map[string]string{
		"truncated":     `{"servers": {"a": {`,
		"comments":      "{\n  // my servers\n  \"servers\": {}\n}\n",
		"trailing":      `{"servers": {"a": {"command": "x"},}}`,
		"not object":    `["servers"]`,
		"servers array": `{"servers": []}`,
	} {
		t.Run(name, func(t *testing.T) {
			project := t.TempDir()
			t.Chdir(project)
			path := filepath.Join(project, ".vscode", "mcp.json")
			os.MkdirAll(filepath.Dir(path), 0o755)
			os.WriteFile(path, []byte(content), 0o644)
			var out, errOut bytes.Buffer
			err := runInstall([]string{"vscode", "--write"}, &out, &errOut)
			if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "changed nothing") {
				t.Errorf("err = %v, want a refusal naming %s", err, path)
			}
			if b, _ := os.ReadFile(path); string(b) != content {
				t.Errorf("refused config changed:\n%s", b)
			}
			noLeftovers(t, filepath.Dir(path), "mcp.json")
		})
	}
}

func TestInstallUsage(t *testing.T) {
	t.Setenv("HOME", t.TempDir())
	for _, args := range [][]string{
		{},
		{"emacs"},
		{"claude-desktop", "--scope", "project"},
		{"cursor", "--write", "--print"},
		{"cursor", "extra"},
	} {
		var out, errOut bytes.Buffer
		if err := runInstall(args, &out, &errOut); err == nil {
			t.Errorf("kiln install %v: no error", args)
		}
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
