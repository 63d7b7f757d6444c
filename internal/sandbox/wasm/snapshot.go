package wasm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
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
// What sandbox.ReseedCode lists (random, numpy's generator, tempfile's
// names) is redrawn in every box; os.urandom is the host's.

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
	// The confined Deno writes into a directory of its own, the only
	// place it may write; kiln moves the file into place.
	out, err := os.MkdirTemp(dir, fmt.Sprintf(".tmp-%d-", os.Getpid()))
	if err != nil {
		return err
	}
	defer os.RemoveAll(out)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	hp := b.hostPaths("")
	hp.out = out
	cmd, opened, err := b.plat.command(hp, func(p paths) []string {
		tmp := filepath.Join(p.out, snapshotFile)
		return []string{"run",
			"--no-prompt", "--no-remote", "--no-npm", "--no-config", "--no-lock", "--cached-only", "--no-code-cache", "--quiet",
			"--allow-read=" + p.pyodide + "," + p.host,
			"--allow-write=" + tmp,
			filepath.Join(p.host, "snapshot.mjs"), p.pyodide, tmp}
	})
	if err != nil {
		return fmt.Errorf("confining deno: %w", err)
	}
	var buf strings.Builder
	cmd.Stdout, cmd.Stderr = &buf, &buf
	err = b.plat.run(ctx, cmd)
	closeAll(opened)
	if err != nil {
		return fmt.Errorf("making the snapshot: %v: %s", err, truncate(strings.TrimSpace(buf.String()), 2000))
	}
	return adoptSnapshot(filepath.Join(out, snapshotFile), p)
}

// snapshotFile is the name the snapshot is written under in its temporary
// directory.
const snapshotFile = "snapshot.bin"

// adoptSnapshot makes the snapshot a Deno process wrote at tmp kiln's:
// a regular file, not empty, owned by kiln and readable by every box's
// uid, renamed to p.
func adoptSnapshot(tmp, p string) error {
	f, err := os.OpenFile(tmp, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("making the snapshot: deno wrote nothing: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || fi.Size() == 0 {
		return errors.New("making the snapshot: deno wrote nothing")
	}
	if err := f.Chown(os.Geteuid(), os.Getegid()); err != nil {
		return fmt.Errorf("adopting the snapshot: %w", err)
	}
	if err := f.Chmod(0o644); err != nil {
		return fmt.Errorf("adopting the snapshot: %w", err)
	}
	return os.Rename(tmp, p)
}

// env is the whole environment of a Deno process that sees the host
// scripts at host: nothing of kiln's.
func (b *Backend) env(host string) []string {
	return []string{
		// Deno keeps caches (module analysis, V8 code) in DENO_DIR,
		// and writes there whatever modules code makes it load (data:
		// URLs): a path below a file can never be created, so every
		// cache stays in memory and a box writes nothing.
		"DENO_DIR=" + filepath.Join(host, "driver.py", "no-deno-dir"),
		"DENO_NO_UPDATE_CHECK=1",
		"NO_COLOR=1",
	}
}
