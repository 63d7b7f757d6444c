package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"
)

// mcpClient is an MCP client whose config kiln install writes to.
type mcpClient struct {
	name string
	// serversKey is the top-level object of the config that holds the
	// servers, by name.
	serversKey string
	// stdioType adds "type": "stdio" to the entry, where the format
	// requires it.
	stdioType bool
	// scopes are where the config may live, the default first; path
	// gives the file of each.
	scopes []string
	path   func(scope string) (string, error)
	// app is what to restart once the config changed.
	app string
	// printHint, if set, adds how else to add kiln to what is printed.
	printHint func(w io.Writer, exe string, args []string)
}

const (
	scopeUser    = "user"
	scopeProject = "project"
)

// mcpClients are the clients kiln install knows. Their formats and paths:
// Claude Desktop's claude_desktop_config.json; Claude Code's project
// .mcp.json; Cursor's ~/.cursor/mcp.json and a project's .cursor/mcp.json;
// VS Code's .vscode/mcp.json in the workspace and mcp.json in the user
// profile, whose servers sit under "servers" with a "type".
var mcpClients = []mcpClient{
	{
		name: "claude-desktop", serversKey: "mcpServers", scopes: []string{scopeUser}, app: "Claude Desktop",
		path: func(string) (string, error) { return desktopConfigPath() },
	},
	{
		name: "claude-code", serversKey: "mcpServers", scopes: []string{scopeProject}, app: "Claude Code",
		path: func(string) (string, error) { return projectPath(".mcp.json") },
		printHint: func(w io.Writer, exe string, args []string) {
			fmt.Fprintf(w, "or run:\n  claude mcp add kiln -- %s %s\n", exe, strings.Join(args, " "))
		},
	},
	{
		name: "cursor", serversKey: "mcpServers", scopes: []string{scopeUser, scopeProject}, app: "Cursor",
		path: func(scope string) (string, error) {
			if scope == scopeProject {
				return projectPath(".cursor", "mcp.json")
			}
			home, err := homeDir("the Cursor config")
			return filepath.Join(home, ".cursor", "mcp.json"), err
		},
	},
	{
		name: "vscode", serversKey: "servers", stdioType: true, scopes: []string{scopeProject, scopeUser}, app: "VS Code (or run MCP: List Servers)",
		path: func(scope string) (string, error) {
			if scope == scopeProject {
				return projectPath(".vscode", "mcp.json")
			}
			return vscodeUserPath()
		},
	},
}

func clientNames() string {
	var names []string
	for _, c := range mcpClients {
		names = append(names, c.name)
	}
	return strings.Join(names, "|")
}

const installHelp = `Usage of kiln install:
  kiln install CLIENT [--write] [--scope user|project] [--backend B] [--config FILE]

CLIENT is %s.
kiln install prints the entry that starts kiln (absolute paths) and the
file it belongs in; --write merges it into that file instead: other
servers and keys stay as they are, the old file is kept as
FILE.bak-<time>, and a file that is not valid JSON (comments included) is
left alone. Scopes: claude-desktop user; claude-code project
(.mcp.json here); cursor user (~/.cursor/mcp.json, default) or project
(.cursor/mcp.json here); vscode project (.vscode/mcp.json here, default) or
user (mcp.json in the user profile).

`

func runInstall(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln install", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, installHelp, clientNames())
		fs.PrintDefaults()
	}
	write := fs.Bool("write", false, "merge the entry into the client's config file (default: print it)")
	printOnly := fs.Bool("print", false, "print the entry and where it goes, write nothing (the default)")
	scope := fs.String("scope", "", "user or project: which of the client's config files (default: the client's usual one)")
	backend := fs.String("backend", "jail", "backend the entry starts kiln with")
	cfg := fs.String("config", "", "configuration file the entry starts kiln with (made absolute)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	// Flags may follow the client's name too (kiln install cursor --write).
	name := fs.Arg(0)
	if fs.NArg() > 1 {
		if err := fs.Parse(fs.Args()[1:]); err != nil {
			return err
		}
		if fs.NArg() != 0 {
			return fmt.Errorf("usage: kiln install %s [--write]: unexpected %q", clientNames(), fs.Arg(0))
		}
	}
	if name == "" {
		return fmt.Errorf("usage: kiln install %s [--write]", clientNames())
	}
	if *write && *printOnly {
		return errors.New("give --write or --print, not both")
	}
	var c *mcpClient
	for i := range mcpClients {
		if mcpClients[i].name == name {
			c = &mcpClients[i]
		}
	}
	if c == nil {
		return fmt.Errorf("unknown client %q (%s)", name, strings.ReplaceAll(clientNames(), "|", ", "))
	}
	if *scope == "" {
		*scope = c.scopes[0]
	}
	if !slices.Contains(c.scopes, *scope) {
		return fmt.Errorf("%s has no %s config kiln writes (scopes: %s)", c.name, *scope, strings.Join(c.scopes, ", "))
	}
	if err := checkInstallUser(os.Getuid(), os.Getenv("SUDO_USER"), *write); err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	if exe, err = filepath.EvalSymlinks(exe); err != nil {
		return err
	}
	serverArgs := []string{"mcp"}
	if *backend != "jail" {
		serverArgs = append(serverArgs, "--backend", *backend)
	}
	if *cfg != "" {
		p, err := filepath.Abs(*cfg)
		if err != nil {
			return err
		}
		serverArgs = append(serverArgs, "--config", p)
	}
	entry := c.entry(exe, serverArgs)
	path, err := c.path(*scope)
	if err != nil {
		return err
	}
	if !*write {
		b, _ := json.MarshalIndent(map[string]any{c.serversKey: map[string]any{"kiln": entry}}, "", "  ")
		fmt.Fprintf(stdout, "%s\n\nmerge it into %s (or run: kiln install %s --write", b, path, c.name)
		if *scope != c.scopes[0] {
			fmt.Fprintf(stdout, " --scope %s", *scope)
		}
		fmt.Fprintln(stdout, ")")
		if c.printHint != nil {
			c.printHint(stdout, exe, serverArgs)
		}
		return nil
	}
	changed, backup, err := mergeEntry(path, c.serversKey, entry, *scope == scopeProject)
	if err != nil {
		return err
	}
	switch {
	case !changed:
		fmt.Fprintf(stdout, "%s already holds this kiln entry; nothing changed\n", path)
	case backup != "":
		fmt.Fprintf(stdout, "wrote the kiln entry to %s (the old file is %s); restart %s\n", path, backup, c.app)
	default:
		fmt.Fprintf(stdout, "wrote the kiln entry to %s; restart %s\n", path, c.app)
	}
	return nil
}

// checkInstallUser refuses to write an entry under sudo: HOME and the
// current directory are still the user's, so root would write (and own)
// the user's client config, and the client, run as the user, would start
// kiln as the user with a file it may not replace. Run as the user, kiln
// serves rootless (kiln doctor says what that needs).
func checkInstallUser(uid int, sudoUser string, write bool) error {
	if uid == 0 && sudoUser != "" && write {
		return fmt.Errorf("kiln install runs as root under sudo, but %s's client starts kiln as %s: run kiln install without sudo (kiln doctor, as %s, says what a rootless kiln needs)", sudoUser, sudoUser, sudoUser)
	}
	return nil
}

func (c *mcpClient) entry(exe string, args []string) map[string]any {
	e := map[string]any{"command": exe, "args": args}
	if c.stdioType {
		e["type"] = "stdio"
	}
	return e
}

// homeDir is the user's home directory. It never guesses: without an
// absolute HOME it fails, naming what it was looking for.
func homeDir(what string) (string, error) {
	home := os.Getenv("HOME")
	if home == "" || !filepath.IsAbs(home) {
		return "", fmt.Errorf("finding %s: HOME is %q, not an absolute directory; set HOME", what, home)
	}
	return home, nil
}

// desktopConfigPath is where Claude Desktop keeps its config. It never
// guesses: without an absolute HOME (APPDATA on Windows) it fails.
func desktopConfigPath() (string, error) {
	if runtime.GOOS == "windows" {
		dir := os.Getenv("APPDATA")
		if dir == "" || !filepath.IsAbs(dir) {
			return "", fmt.Errorf("finding the Claude Desktop config: APPDATA is %q, not an absolute directory; set it", dir)
		}
		return filepath.Join(dir, "Claude", "claude_desktop_config.json"), nil
	}
	home, err := homeDir("the Claude Desktop config")
	if err != nil {
		return "", err
	}
	if runtime.GOOS == "darwin" {
		return filepath.Join(home, "Library", "Application Support", "Claude", "claude_desktop_config.json"), nil
	}
	return filepath.Join(home, ".config", "Claude", "claude_desktop_config.json"), nil
}

// vscodeUserPath is mcp.json in VS Code's user profile.
func vscodeUserPath() (string, error) {
	switch runtime.GOOS {
	case "windows":
		dir := os.Getenv("APPDATA")
		if dir == "" || !filepath.IsAbs(dir) {
			return "", fmt.Errorf("finding the VS Code user profile: APPDATA is %q, not an absolute directory; set it", dir)
		}
		return filepath.Join(dir, "Code", "User", "mcp.json"), nil
	case "darwin":
		home, err := homeDir("the VS Code user profile")
		return filepath.Join(home, "Library", "Application Support", "Code", "User", "mcp.json"), err
	}
	if dir := os.Getenv("XDG_CONFIG_HOME"); filepath.IsAbs(dir) {
		return filepath.Join(dir, "Code", "User", "mcp.json"), nil
	}
	home, err := homeDir("the VS Code user profile")
	return filepath.Join(home, ".config", "Code", "User", "mcp.json"), err
}

// projectPath is a file of the project in the current directory.
func projectPath(elem ...string) (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("finding the project directory: %w", err)
	}
	return filepath.Join(append([]string{wd}, elem...)...), nil
}

// mergeEntry adds or replaces the kiln entry under serversKey in the
// config at path and keeps everything else as it was: every other value
// byte for byte (numbers are never parsed), in its order. It refuses a
// file that is not a JSON object whose serversKey, if present, is an
// object, and a symbolic link at path. The old file is kept as
// path.bak-<time> (returned); the new one replaces it by a rename, with
// mode 0600 (a user's config may hold other servers' secrets), or in a
// project, which others share, the old file's mode or 0644. It writes
// nothing when the entry is already there as it would write it.
func mergeEntry(path, serversKey string, entry map[string]any, project bool) (changed bool, backup string, err error) {
	kiln, err := json.Marshal(entry)
	if err != nil {
		return false, "", err
	}
	old, exists, err := readConfig(path)
	if err != nil {
		return false, "", err
	}
	refuse := func(err error) (bool, string, error) {
		return false, "", fmt.Errorf("%s: %w; kiln changed nothing: fix it or merge the entry by hand (kiln install prints it)", path, err)
	}
	var top []member
	if len(bytes.TrimSpace(old)) > 0 {
		if top, err = parseObject(old, ""); err != nil {
			if bytes.Contains(old, []byte("//")) || bytes.Contains(old, []byte("/*")) {
				err = fmt.Errorf("%w (comments are not JSON, and kiln would not keep them)", err)
			}
			return refuse(err)
		}
	}
	var servers []member
	at := -1
	quoted, _ := json.Marshal(serversKey)
	for i, m := range top {
		if m.key != serversKey {
			continue
		}
		if at >= 0 {
			return refuse(fmt.Errorf("%s twice", quoted))
		}
		if servers, err = parseObject(m.value, string(quoted)); err != nil {
			return refuse(err)
		}
		at = i
	}
	for _, m := range servers {
		var a, b bytes.Buffer
		if m.key == "kiln" && json.Compact(&a, m.value) == nil && json.Compact(&b, kiln) == nil && a.String() == b.String() {
			return false, "", nil
		}
	}
	servers = setMember(servers, "kiln", kiln)
	if at < 0 {
		top = append(top, member{key: serversKey})
		at = len(top) - 1
	}
	top[at].value = encodeObject(servers)
	var out bytes.Buffer
	if err := json.Indent(&out, encodeObject(top), "", "  "); err != nil {
		return false, "", fmt.Errorf("formatting %s: %w", path, err)
	}
	out.WriteByte('\n')

	perm, dirPerm := os.FileMode(0o600), os.FileMode(0o700)
	if project {
		perm, dirPerm = 0o644, 0o755
	}
	if err := os.MkdirAll(filepath.Dir(path), dirPerm); err != nil {
		return false, "", err
	}
	if exists {
		if fi, err := os.Stat(path); err == nil && project {
			perm = fi.Mode().Perm()
		}
		if backup, err = writeBackup(path, old); err != nil {
			return false, "", fmt.Errorf("backing up %s: %w", path, err)
		}
	}
	if err := writeAtomic(path, out.Bytes(), perm); err != nil {
		return false, backup, err
	}
	return true, backup, nil
}

// writeBackup keeps data as path.bak-<UTC time>, mode 0600 (the config may
// hold other servers' secrets), never replacing an earlier backup.
func writeBackup(path string, data []byte) (string, error) {
	base := path + ".bak-" + time.Now().UTC().Format("20060102T150405Z")
	for i := 1; ; i++ {
		name := base
		if i > 1 {
			name = fmt.Sprintf("%s-%d", base, i)
		}
		f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, os.ErrExist) && i < 100 {
			continue
		}
		if err != nil {
			return "", err
		}
		if _, err := f.Write(data); err != nil {
			f.Close()
			os.Remove(name)
			return "", err
		}
		if err := f.Sync(); err != nil {
			f.Close()
			os.Remove(name)
			return "", err
		}
		return name, f.Close()
	}
}
