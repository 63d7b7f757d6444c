package wasm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"kiln/internal/sandbox"
)

// Pyodide's cold start (loading and compiling its WebAssembly, starting
// Python, importing the standard library's start-up modules) takes seconds;
// restoring a memory snapshot of the result takes a fraction of that. The
// backend makes one snapshot, once per host scripts and Pyodide, in a Deno
// process that runs no model code and may write only that file; boxes
// restore it and never write it.
//
// What boxes of one snapshot share is what Python fixed while it started:
// its string-hash seed (hash("…")), as jail boxes of one zygote do.
// random is reseeded in every box; os.urandom is the host's.

var _ sandbox.Warmer = (*Backend)(nil)

// Warm makes the snapshot ahead of the first box.
func (b *Backend) Warm(ctx context.Context, spec sandbox.Spec) error {
	if b.cold {
		return nil
	}
	b.ensureSnapshot(ctx)
	b.smu.Lock()
	defer b.smu.Unlock()
	return b.snapErr
}

// snapshotPath is where the snapshot of this Pyodide and these host
// scripts lives.
func (b *Backend) snapshotPath() string {
	sum := sha256.Sum256([]byte(b.rt.Pyodide))
	return filepath.Join(b.hostDir+"-snapshots", "pyodide-"+PyodideVersion+"-"+hex.EncodeToString(sum[:6])+".bin")
}

// ensureSnapshot returns the snapshot, making it first if needed; "" when
// it cannot be made (the box then starts cold, and the reason is logged
// once).
func (b *Backend) ensureSnapshot(ctx context.Context) string {
	b.smu.Lock()
	defer b.smu.Unlock()
	if b.snapshot != "" || b.snapErr != nil {
		return b.snapshot
	}
	p := b.snapshotPath()
	if _, err := os.Stat(p); err == nil {
		b.snapshot = p
		return p
	}
	start := time.Now()
	if err := b.makeSnapshot(ctx, p); err != nil {
		if ctx.Err() != nil {
			return "" // try again on a later box
		}
		b.snapErr = err
		b.log.Warn("wasm boxes start cold: no memory snapshot", "err", err)
		return ""
	}
	b.log.Info("made the wasm memory snapshot", "path", p, "took", time.Since(start).Round(time.Millisecond))
	b.snapshot = p
	return p
}

func (b *Backend) makeSnapshot(ctx context.Context, p string) error {
	dir := filepath.Dir(p)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp := filepath.Join(dir, fmt.Sprintf(".tmp-%d-%d", os.Getpid(), time.Now().UnixNano()))
	defer os.Remove(tmp)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, b.rt.Deno, "run",
		"--no-prompt", "--no-remote", "--no-npm", "--no-config", "--no-lock", "--cached-only", "--no-code-cache", "--quiet",
		"--allow-read="+b.rt.Pyodide+","+b.hostDir,
		"--allow-write="+tmp,
		filepath.Join(b.hostDir, "snapshot.mjs"), b.rt.Pyodide, tmp)
	cmd.Env = b.env()
	cmd.Dir = b.hostDir
	b.plat.prepare(cmd)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("making the snapshot: %v: %s", err, truncate(strings.TrimSpace(string(out)), 2000))
	}
	if fi, err := os.Stat(tmp); err != nil || fi.Size() == 0 {
		return errors.New("making the snapshot: deno wrote nothing")
	}
	return os.Rename(tmp, p)
}

// env is the whole environment of a Deno process: nothing of kiln's.
func (b *Backend) env() []string {
	return []string{
		"DENO_DIR=" + b.denoDir,
		"DENO_NO_UPDATE_CHECK=1",
		"NO_COLOR=1",
	}
}
