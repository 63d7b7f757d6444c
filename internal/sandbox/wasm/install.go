package wasm

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/sha512"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"strings"
)

// The runtime of wasm boxes, pinned: Deno's binary and Pyodide, both as
// published on npm, each checked against the sha512 of its npm tarball
// (the "integrity" npm itself records) before anything is unpacked.
const (
	DenoVersion    = "2.9.6"
	PyodideVersion = "314.0.7"
)

// pkg is one pinned npm tarball.
type pkg struct {
	name, version, integrity string
}

// pyodidePkg is the npm Pyodide: the interpreter, its standard library and
// its JavaScript loader; no wheels.
var pyodidePkg = pkg{"pyodide", PyodideVersion, "sha512-0YvXxEhfEdpLfb/XkM2BFAeMROq0iMUX2bzzH9pOttyMcWkwq+HbE5uyuGD82LN7y2q+SNvi/6V5JEsOlD2R1A=="}

// denoPkgs are Deno's per-platform packages, by GOOS/GOARCH.
var denoPkgs = map[string]pkg{
	"linux/amd64":   {"@deno/linux-x64-glibc", DenoVersion, "sha512-3md4TKLCuzsLDmfOoC5KN7NAZaxSVkMgm64vg6foD00JBADCpYS2/5QqXfzgnP5ZQz3iLP9vBQJtEgc116OAoQ=="},
	"linux/arm64":   {"@deno/linux-arm64-glibc", DenoVersion, "sha512-poqhoH9B3nYloigEMPT5t8HY+wBeiuea1An5Q7fqgJzP0SYmWsoS/oUnWO/pEiA4ofzIBy1Elt/in58xKtxEoQ=="},
	"darwin/arm64":  {"@deno/darwin-arm64", DenoVersion, "sha512-V8uO1Aolrl/yvdMb5lOtgtigs8YuZBjrOrgviVMiYkQ0swymFfzkae1wZak4Xi24t7vf7d/eiMb/7ryjjVm+tg=="},
	"darwin/amd64":  {"@deno/darwin-x64", DenoVersion, "sha512-tPi3CWPRdjW1MaWlvWjORE7Ass5SADdWdj1BF1Q1PEdzi+5u/mC5YhmZzniMiPr81PpaFeqjXaLAsfb8lFsZ0Q=="},
	"windows/amd64": {"@deno/win32-x64", DenoVersion, "sha512-qRGnmVz/Ea6UWPht/S3xFRK17UZ/ls38DSVfgGB17fpASLxPkksqzWUI/BzL9YYoOknYzfc94mySGyInZu/JXw=="},
}

// Runtime is an installed Deno and Pyodide.
type Runtime struct {
	Deno    string // the deno binary
	Pyodide string // the directory holding pyodide.mjs
}

// InstallCommand is the one-line setup, for messages.
const InstallCommand = "kiln wasm install"

// ErrNotInstalled is returned when the pinned runtime is not in the cache.
var ErrNotInstalled = errors.New("wasm: Deno and Pyodide are not installed (run: " + InstallCommand + ")")

// CacheDir is where the pinned runtime is installed: dir if set, else
// os.UserCacheDir()/kiln/wasm.
func CacheDir(dir string) (string, error) {
	if dir != "" {
		return filepath.Abs(dir)
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("finding the cache directory: %w", err)
	}
	return filepath.Join(d, "kiln", "wasm"), nil
}

func denoPkg() (pkg, error) {
	p, ok := denoPkgs[runtime.GOOS+"/"+runtime.GOARCH]
	if !ok {
		return pkg{}, fmt.Errorf("%w: no Deno package is pinned for %s/%s", errUnsupportedOS, runtime.GOOS, runtime.GOARCH)
	}
	return p, nil
}

var errUnsupportedOS = errors.New("wasm: not supported on this OS")

func denoBinary(dir string) string {
	name := "deno"
	if runtime.GOOS == "windows" {
		name = "deno.exe"
	}
	return filepath.Join(dir, "deno-"+DenoVersion, name)
}

func pyodideDir(dir string) string { return filepath.Join(dir, "pyodide-"+PyodideVersion) }

// Installed returns the runtime installed under the cache dir (see
// CacheDir), or ErrNotInstalled.
func Installed(dir string) (Runtime, error) {
	dir, err := CacheDir(dir)
	if err != nil {
		return Runtime{}, err
	}
	rt := Runtime{Deno: denoBinary(dir), Pyodide: pyodideDir(dir)}
	for _, p := range []string{rt.Deno, filepath.Join(rt.Pyodide, "pyodide.mjs"), filepath.Join(rt.Pyodide, "pyodide.asm.wasm")} {
		if _, err := os.Stat(p); err != nil {
			return Runtime{}, ErrNotInstalled
		}
	}
	return rt, nil
}

// Install puts the pinned Deno and Pyodide into the cache dir, unless they
// are there already. It fetches each tarball with npm (`npm pack`, from
// whatever registry npm is configured to use), checks its sha512 against
// the pinned value and only then unpacks it. logger may be nil.
func Install(ctx context.Context, dir string, logger *slog.Logger) (Runtime, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if rt, err := Installed(dir); err == nil {
		return rt, nil
	}
	dir, err := CacheDir(dir)
	if err != nil {
		return Runtime{}, err
	}
	dp, err := denoPkg()
	if err != nil {
		return Runtime{}, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Runtime{}, fmt.Errorf("creating %s: %w", dir, err)
	}
	for _, job := range []struct {
		p    pkg
		dest string
	}{{dp, filepath.Dir(denoBinary(dir))}, {pyodidePkg, pyodideDir(dir)}} {
		if _, err := os.Stat(job.dest); err == nil {
			continue
		}
		logger.Info("installing", "package", job.p.name, "version", job.p.version)
		tgz, cleanup, err := npmPack(ctx, job.p)
		if err != nil {
			return Runtime{}, err
		}
		err = unpackVerified(tgz, job.p.integrity, job.dest)
		cleanup()
		if err != nil {
			return Runtime{}, fmt.Errorf("installing %s@%s: %w", job.p.name, job.p.version, err)
		}
	}
	if runtime.GOOS != "windows" {
		if err := os.Chmod(denoBinary(dir), 0o755); err != nil {
			return Runtime{}, err
		}
	}
	return Installed(dir)
}

// npmPack fetches p's tarball into a temporary directory with npm.
func npmPack(ctx context.Context, p pkg) (string, func(), error) {
	npm, err := exec.LookPath("npm")
	if err != nil {
		return "", nil, fmt.Errorf("finding npm (kiln fetches Deno and Pyodide from npm): %w", err)
	}
	tmp, err := os.MkdirTemp("", "kiln-wasm-pack-")
	if err != nil {
		return "", nil, err
	}
	cleanup := func() { os.RemoveAll(tmp) }
	cmd := exec.CommandContext(ctx, npm, "pack", "--json", "--pack-destination", tmp, p.name+"@"+p.version)
	cmd.Dir = tmp
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		cleanup()
		return "", nil, fmt.Errorf("fetching %s@%s with npm pack: %v: %s", p.name, p.version, err, strings.TrimSpace(stderr.String()))
	}
	var packed []struct {
		Filename string `json:"filename"`
	}
	if err := json.Unmarshal(out, &packed); err != nil || len(packed) != 1 || packed[0].Filename == "" {
		cleanup()
		return "", nil, fmt.Errorf("fetching %s@%s: npm pack printed %q", p.name, p.version, truncate(string(out), 200))
	}
	return filepath.Join(tmp, filepath.Base(packed[0].Filename)), cleanup, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// checkIntegrity compares the sha512 of the file at p with an npm
// integrity string ("sha512-<base64>").
func checkIntegrity(p, integrity string) error {
	want, ok := strings.CutPrefix(integrity, "sha512-")
	if !ok {
		return fmt.Errorf("integrity %q is not sha512", integrity)
	}
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	h := sha512.New()
	if _, err := io.Copy(h, f); err != nil {
		return err
	}
	if got := base64.StdEncoding.EncodeToString(h.Sum(nil)); got != want {
		return fmt.Errorf("sha512 mismatch: got sha512-%s, pinned %s", got, integrity)
	}
	return nil
}

// unpackVerified checks the tarball at tgz against integrity, then unpacks
// its package/ directory into dest (made through a temporary sibling and
// renamed, so a half-unpacked dest never exists). Entries other than
// regular files and directories, and names that leave package/, are
// refused.
func unpackVerified(tgz, integrity, dest string) error {
	if err := checkIntegrity(tgz, integrity); err != nil {
		return err
	}
	f, err := os.Open(tgz)
	if err != nil {
		return err
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return fmt.Errorf("reading tarball: %w", err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dest), ".unpack-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("reading tarball: %w", err)
		}
		name := path.Clean(h.Name)
		rel, ok := strings.CutPrefix(name, "package/")
		if !ok || rel == "" || strings.HasPrefix(rel, "../") || path.IsAbs(rel) {
			return fmt.Errorf("tarball entry %q is outside package/", h.Name)
		}
		target := filepath.Join(tmp, filepath.FromSlash(rel))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
				return err
			}
			mode := os.FileMode(0o644)
			if h.Mode&0o111 != 0 {
				mode = 0o755
			}
			w, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
			if err != nil {
				return err
			}
			_, err = io.Copy(w, tr)
			if cerr := w.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		default:
			return fmt.Errorf("tarball entry %q is not a file or directory", h.Name)
		}
	}
	// Public files: the confined Deno's uid must read them (MkdirTemp
	// made the directory 0700).
	if err := os.Chmod(tmp, 0o755); err != nil {
		return err
	}
	return os.Rename(tmp, dest)
}
