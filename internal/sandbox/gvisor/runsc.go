package gvisor

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// RunscVersion is the gVisor module version kiln builds runsc from. It must
// equal the gvisor.dev/gvisor requirement in go.mod, where runsc is pinned
// as a tool (a test checks).
const RunscVersion = "v0.0.0-20260905035102-160fafc42237"

const runscPackage = "gvisor.dev/gvisor/runsc"

// ErrDynamicRunsc is returned for a runsc binary that needs an ELF
// interpreter. runsc's boot process pivots into an empty root and
// re-executes itself through /proc/self/exe, where no dynamic loader exists,
// so such a binary fails at start with "fork/exec /proc/self/exe: no such
// file or directory".
var ErrDynamicRunsc = errors.New("runsc is dynamically linked and cannot start sandboxes; build it static with CGO_ENABLED=0 (kiln builds its own pinned runsc when --runsc is not given)")

// CheckStatic reports whether the ELF file at path is statically linked
// (has no PT_INTERP program header).
func CheckStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("reading runsc binary: %w", err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s: %w", path, ErrDynamicRunsc)
		}
	}
	return nil
}

// runscBuild names how kiln builds runsc, in its cache file's name, so that
// a change of build replaces an older cached binary: "ps1" is the build
// with precompiled seccomp programs (runsc_build.go).
const runscBuild = "ps1"

// CachedRunscPath is where EnsureRunsc puts the pinned runsc:
// <user cache dir>/kiln/bin/runsc-<RunscVersion>-<build>.
func CachedRunscPath() (string, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("finding the cache directory: %w", err)
	}
	return filepath.Join(dir, "kiln", "bin", "runsc-"+RunscVersion+"-"+runscBuild), nil
}

// EnsureRunsc returns the path of the pinned, static runsc in kiln's cache,
// building it first if it is not there. Building needs the go command (on
// PATH or in /usr/local/go/bin) and the Go module proxy; it takes a few
// minutes with two cores (runsc_build.go: it precompiles the sentry's
// seccomp programs, and falls back to a plain go install). The module
// checksums are verified as for any go build. logger may be nil.
func EnsureRunsc(ctx context.Context, logger *slog.Logger) (string, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	path, err := CachedRunscPath()
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(path); err == nil {
		if err := CheckStatic(path); err != nil {
			return "", err
		}
		return path, nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return "", fmt.Errorf("creating runsc cache directory: %w", err)
	}
	goBin, err := findGo()
	if err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(path), ".runsc-build-")
	if err != nil {
		return "", fmt.Errorf("creating runsc build directory: %w", err)
	}
	defer os.RemoveAll(tmp)

	logger.Info("building runsc (once; a few minutes)", "version", RunscVersion, "dest", path)
	start := time.Now()
	built, err := buildRunscPrecompiled(ctx, goBin, tmp)
	if err != nil {
		if ctx.Err() != nil {
			return "", fmt.Errorf("building runsc %s: %w", RunscVersion, err)
		}
		// The plain build: runsc builds its seccomp program at start.
		logger.Warn("building runsc with precompiled seccomp programs failed; building it plain", "err", err)
		cmd := exec.CommandContext(ctx, goBin, "install", "-trimpath", "-ldflags="+runscLdflags, runscPackage+"@"+RunscVersion)
		cmd.Dir = tmp // outside any module: the pin is the only input
		cmd.Env = buildEnv(os.Environ(), tmp)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			return "", fmt.Errorf("building runsc %s: %w: %s", RunscVersion, err, tail(out.String(), 2000))
		}
		built = filepath.Join(tmp, "runsc")
	}
	if err := CheckStatic(built); err != nil {
		return "", err
	}
	if err := os.Rename(built, path); err != nil {
		return "", fmt.Errorf("installing runsc: %w", err)
	}
	logger.Info("built runsc", "path", path, "took", time.Since(start).Round(time.Second))
	return path, nil
}

// buildEnv is the environment of the runsc build: static, native, module
// mode, with the binary going to gobin.
func buildEnv(environ []string, gobin string) []string {
	drop := map[string]bool{"CGO_ENABLED": true, "GOBIN": true, "GOOS": true, "GOARCH": true, "GOFLAGS": true, "GOWORK": true, "GO111MODULE": true}
	var env []string
	for _, kv := range environ {
		k, _, _ := strings.Cut(kv, "=")
		if !drop[k] {
			env = append(env, kv)
		}
	}
	return append(env, "CGO_ENABLED=0", "GOBIN="+gobin, "GOWORK=off", "GO111MODULE=on", "GOFLAGS=-buildvcs=false")
}

func findGo() (string, error) {
	if p, err := exec.LookPath("go"); err == nil {
		return p, nil
	}
	const fallback = "/usr/local/go/bin/go"
	if _, err := os.Stat(fallback); err == nil {
		return fallback, nil
	}
	return "", errors.New("finding the go command to build runsc: not on PATH nor at /usr/local/go/bin/go; install Go or pass a static runsc")
}

// runscVersion asks runsc for its version ("runsc version X").
func runscVersion(ctx context.Context, runsc string) (string, error) {
	out, err := exec.CommandContext(ctx, runsc, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("asking runsc for its version: %w", err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(strings.TrimPrefix(first, "runsc version")), nil
}

func tail(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}
