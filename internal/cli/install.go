package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"log/slog"
)

func runInstall(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln install", flag.ContinueOnError)
	fs.SetOutput(stderr)
	write := fs.Bool("write", false, "write the entry into the client's config file (claude-desktop) instead of printing it")
	backend := fs.String("backend", "jail", "backend the entry starts kiln with")
	if err := fs.Parse(args); err != nil {
		return err
	}
	// Flags may follow the client's name too (kiln install claude-desktop --write).
	client := fs.Arg(0)
	if fs.NArg() > 1 {
		if err := fs.Parse(fs.Args()[1:]); err != nil {
			return err
		}
		if fs.NArg() != 0 {
			client = ""
		}
	}
	if client == "" {
		return errors.New("usage: kiln install claude-desktop|claude-code [--write]")
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
	entry := map[string]any{"command": exe, "args": serverArgs}
	switch client {
	case "claude-code":
		fmt.Fprintf(stdout, "claude mcp add kiln -- %s", exe)
		for _, a := range serverArgs {
			fmt.Fprintf(stdout, " %s", a)
		}
		fmt.Fprintln(stdout)
		b, _ := json.MarshalIndent(map[string]any{"mcpServers": map[string]any{"kiln": entry}}, "", "  ")
		fmt.Fprintf(stdout, "\nor put this in .mcp.json at the project root:\n%s\n", b)
		return nil
	case "claude-desktop":
		path, err := desktopConfigPath()
		if err != nil {
			return err
		}
		if !*write {
			b, _ := json.MarshalIndent(map[string]any{"mcpServers": map[string]any{"kiln": entry}}, "", "  ")
			fmt.Fprintf(stdout, "%s\n\nmerge it into %s (or run: kiln install claude-desktop --write)\n", b, path)
			return nil
		}
		return mergeDesktopConfig(path, entry, stdout)
	}
	return fmt.Errorf("unknown client %q (claude-desktop or claude-code)", client)
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
	home := os.Getenv("HOME")
	if home == "" || !filepath.IsAbs(home) {
		return "", fmt.Errorf("finding the Claude Desktop config: HOME is %q, not an absolute directory; set HOME", home)
	}
	if runtime.GOOS == "darwin" {
		return filepath.Join(home, "Library", "Application Support", "Claude", "claude_desktop_config.json"), nil
	}
	return filepath.Join(home, ".config", "Claude", "claude_desktop_config.json"), nil
}

// mergeDesktopConfig adds or replaces the kiln entry in the config at path
// and keeps everything else as it was: every other value byte for byte
// (numbers are never parsed), in its order. It refuses a file that is not
// a JSON object whose mcpServers, if present, is an object, and a symbolic
// link at path. The old file is kept as path.bak; the new one replaces it
// by a rename, with mode 0600.
func mergeDesktopConfig(path string, entry map[string]any, stdout io.Writer) error {
	kiln, err := json.Marshal(entry)
	if err != nil {
		return err
	}
	old, exists, err := readConfig(path)
	if err != nil {
		return err
	}
	var top []member
	if len(bytes.TrimSpace(old)) > 0 {
		if top, err = parseObject(old, ""); err != nil {
			return fmt.Errorf("%s: %w; fix it or merge the entry by hand", path, err)
		}
	}
	var servers []member
	at := -1
	for i, m := range top {
		if m.key != "mcpServers" {
			continue
		}
		if at >= 0 {
			return fmt.Errorf("%s: %w; fix it or merge the entry by hand", path, errors.New(`"mcpServers" twice`))
		}
		if servers, err = parseObject(m.value, `"mcpServers"`); err != nil {
			return fmt.Errorf("%s: %w; fix it or merge the entry by hand", path, err)
		}
		at = i
	}
	servers = setMember(servers, "kiln", kiln)
	if at < 0 {
		top = append(top, member{key: "mcpServers"})
		at = len(top) - 1
	}
	top[at].value = encodeObject(servers)
	var out bytes.Buffer
	if err := json.Indent(&out, encodeObject(top), "", "  "); err != nil {
		return fmt.Errorf("formatting %s: %w", path, err)
	}
	out.WriteByte('\n')

	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	note := ""
	if exists {
		if err := writeAtomic(path+".bak", old); err != nil {
			return fmt.Errorf("backing up %s: %w", path, err)
		}
		note = " (the old file is " + path + ".bak)"
	}
	if err := writeAtomic(path, out.Bytes()); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote the kiln entry to %s%s; restart Claude Desktop\n", path, note)
	return nil
}

// readConfig reads the config at path, refusing anything but a regular
// file there: kiln does not write through a symbolic link it was not
// told about.
func readConfig(path string) (data []byte, exists bool, err error) {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, false, nil
	case err != nil:
		return nil, false, err
	case fi.Mode()&os.ModeSymlink != 0:
		target, _ := os.Readlink(path)
		return nil, false, fmt.Errorf("%s is a symbolic link (to %s); kiln does not write through it: merge the entry by hand, or replace the link with the file", path, target)
	case !fi.Mode().IsRegular():
		return nil, false, fmt.Errorf("%s is not a regular file (%v); merge the entry by hand", path, fi.Mode().Type())
	}
	data, err = os.ReadFile(path)
	return data, true, err
}

// member is one key of a JSON object with its value as written.
type member struct {
	key   string
	value json.RawMessage
}

// parseObject splits a JSON object into its members, in order, leaving
// each value as written. what names the value in errors ("" for the file).
func parseObject(data []byte, what string) ([]member, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("not valid JSON: %w", err)
	}
	if tok != json.Delim('{') {
		kind := jsonKind(tok)
		if what == "" {
			return nil, fmt.Errorf("the file holds %s, not a JSON object", kind)
		}
		return nil, fmt.Errorf("%s is %s, not an object", what, kind)
	}
	var ms []member
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("not valid JSON: %w", err)
		}
		var m member
		m.key, _ = tok.(string)
		if err := dec.Decode(&m.value); err != nil {
			return nil, fmt.Errorf("not valid JSON: %w", err)
		}
		ms = append(ms, m)
	}
	if _, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("not valid JSON: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("not valid JSON: data after the object")
	}
	return ms, nil
}

// jsonKind names the JSON value that starts with tok.
func jsonKind(tok json.Token) string {
	switch tok.(type) {
	case nil:
		return "null"
	case json.Delim:
		return "an array"
	case string:
		return "a string"
	case bool:
		return "a boolean"
	}
	return "a number"
}

// setMember replaces every member named key with one holding value, at the
// first one's place, or appends it.
func setMember(ms []member, key string, value json.RawMessage) []member {
	out := ms[:0:0]
	done := false
	for _, m := range ms {
		if m.key != key {
			out = append(out, m)
		} else if !done {
			out = append(out, member{key, value})
			done = true
		}
	}
	if !done {
		out = append(out, member{key, value})
	}
	return out
}

func encodeObject(ms []member) json.RawMessage {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, m := range ms {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(m.key)
		b.Write(k)
		b.WriteByte(':')
		b.Write(m.value)
	}
	b.WriteByte('}')
	return b.Bytes()
}

// writeAtomic replaces path with data, mode 0600: a temporary file in the
// same directory, synced, then renamed over path.
func writeAtomic(path string, data []byte) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := f.Chmod(0o600); err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("replacing %s: %w", path, err)
	}
	return nil
}

func runDoctor(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln doctor", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c common
	c.register(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	ok := 0
	for _, e := range registry {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		err := c.backends.checkBackend(ctx, e.name, backendEnv{agent: c.agent, log: discard()}, func(note string) {
			fmt.Fprintf(stderr, "%-8s note: %s\n", e.name, note)
		})
		cancel()
		if err == nil {
			ok++
			fmt.Fprintf(stdout, "%-8s ok\n", e.name)
		} else {
			fmt.Fprintf(stdout, "%-8s not available: %v\n", e.name, err)
		}
	}
	if ok == 0 {
		return errors.New("no backend works on this host")
	}
	return nil
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }
