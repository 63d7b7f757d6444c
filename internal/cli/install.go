package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"log/slog"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/gvisor"
)

func runInstall(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln install", flag.ContinueOnError)
	fs.SetOutput(stderr)
	write := fs.Bool("write", false, "write the entry into the client's config file (claude-desktop) instead of printing it")
	backend := fs.String("backend", "jail", "backend the entry starts kiln with")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
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
	switch fs.Arg(0) {
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
		path := desktopConfigPath()
		if !*write {
			b, _ := json.MarshalIndent(map[string]any{"mcpServers": map[string]any{"kiln": entry}}, "", "  ")
			fmt.Fprintf(stdout, "%s\n\nmerge it into %s (or run: kiln install claude-desktop --write)\n", b, path)
			return nil
		}
		return mergeDesktopConfig(path, entry, stdout)
	}
	return fmt.Errorf("unknown client %q (claude-desktop or claude-code)", fs.Arg(0))
}

func desktopConfigPath() string {
	home, _ := os.UserHomeDir()
	switch runtime.GOOS {
	case "darwin":
		return filepath.Join(home, "Library", "Application Support", "Claude", "claude_desktop_config.json")
	case "windows":
		return filepath.Join(os.Getenv("APPDATA"), "Claude", "claude_desktop_config.json")
	}
	return filepath.Join(home, ".config", "Claude", "claude_desktop_config.json")
}

// mergeDesktopConfig adds or replaces the kiln entry, keeping everything
// else in the file.
func mergeDesktopConfig(path string, entry map[string]any, stdout io.Writer) error {
	cfg := map[string]any{}
	if b, err := os.ReadFile(path); err == nil {
		if err := json.Unmarshal(b, &cfg); err != nil {
			return fmt.Errorf("%s is not valid JSON; fix it or merge by hand: %w", path, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	servers, _ := cfg["mcpServers"].(map[string]any)
	if servers == nil {
		servers = map[string]any{}
	}
	servers["kiln"] = entry
	cfg["mcpServers"] = servers
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote the kiln entry to %s; restart Claude Desktop\n", path)
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
	log := discard()
	ok := 0
	for _, name := range []string{"jail", "gvisor", "microvm"} {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		err := checkBackend(ctx, name, c.agent, c.runsc, c.accel, log)
		cancel()
		if err == nil {
			ok++
			fmt.Fprintf(stdout, "%-8s ok\n", name)
		} else {
			fmt.Fprintf(stdout, "%-8s not available: %v\n", name, err)
		}
	}
	fmt.Fprintf(stdout, "%-8s not built yet in this version\n", "wasm")
	if ok == 0 {
		return errors.New("no backend works on this host")
	}
	return nil
}

func checkBackend(ctx context.Context, name, agent, runsc, accel string, log *slog.Logger) error {
	if name == "gvisor" && runsc == "" {
		// Doctor does not build runsc (a minute or more); it checks the cached one.
		p, err := cachedRunsc()
		if err != nil {
			return err
		}
		runsc = p
	}
	b, err := newBackend(ctx, name, agent, runsc, false, accel, nil, log)
	if err != nil {
		return err
	}
	if c, ok := b.(closer); ok {
		defer c.Close()
	}
	if chk, ok := b.(sandbox.Checker); ok {
		if err := chk.Check(ctx); err != nil {
			return err
		}
	}
	if n, ok := b.(interface{ Notes() []string }); ok {
		for _, note := range n.Notes() {
			fmt.Fprintf(os.Stderr, "%-8s note: %s\n", name, note)
		}
	}
	// A backend whose check does not start a box (microvm) proves here
	// that one starts and runs code.
	if name == "microvm" {
		box, err := b.Create(ctx, sandbox.Spec{ID: "doctor"})
		if err != nil {
			return fmt.Errorf("starting a VM: %w", err)
		}
		defer box.Close()
		res, err := box.RunShell(ctx, "echo ok", sandbox.ExecOptions{})
		if err != nil {
			return fmt.Errorf("running code in a VM: %w", err)
		}
		if strings.TrimSpace(res.Stdout.Text) != "ok" {
			return fmt.Errorf("running code in a VM: got %q", res.Stdout.Text)
		}
	}
	return nil
}

func cachedRunsc() (string, error) {
	p, err := gvisor.CachedRunscPath()
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("runsc is not built yet (make runsc, or start kiln with --backend gvisor once): %w", err)
	}
	return p, nil
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }
