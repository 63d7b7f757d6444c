// Package wasm is kiln's WebAssembly backend: Python compiled to
// WebAssembly (Pyodide), hosted by Deno with no permission beyond reading
// the Pyodide files and kiln's own host scripts.
//
// Each box is one Deno process. Its main thread (host/host.mjs) speaks
// kiln's agent protocol on stdin and stdout, so the session, pool and MCP
// layers see a box like any other; a worker thread (host/kernel.mjs) runs
// Pyodide with kiln's own kernel driver (internal/kernel), so results,
// displays and tracebacks are the same as on every other backend.
//
// The boundary is Deno's permission system, not Pyodide: Python reaches
// JavaScript through the js module, and from there whatever Deno allows.
// Deno runs with --no-prompt, no --allow-net, --allow-env, --allow-run,
// --allow-write, --allow-ffi or --allow-import, --allow-read limited to
// the Pyodide directory and the host scripts, and no remote or npm
// modules. Memory is bounded three ways: Pyodide's WebAssembly heap (where
// Python's objects and the in-memory workspace live) cannot grow past the
// box's memory limit, which Python sees as a MemoryError; V8's own heap is
// capped with --max-old-space-size; and on Linux the whole process runs
// in a cgroup (boxkit) with both plus the runtime's own slack. A cell that
// ignores an interrupt (a loop in JavaScript, a long C call) is stopped by
// killing the process: WebAssembly cannot be preempted.
//
// On Linux, Deno itself is confined (box_linux.go): its own namespaces,
// an unused host uid, no capabilities, no_new_privs and the seccomp filter
// boxpolicy.DenoSyscallPolicy, so that a Deno or V8 bug reached from Python
// is not the host's root.
//
// There is no shell: run_shell is refused, and servers do not offer it.
package wasm

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	_ "embed"

	"kiln/internal/boxpolicy"
	"kiln/internal/kernel"
	"kiln/internal/sandbox"
)

//go:embed host/host.mjs
var hostScript string

//go:embed host/kernel.mjs
var kernelScript string

//go:embed host/snapshot.mjs
var snapshotScript string

// PythonVersion is the Python of the pinned Pyodide.
const PythonVersion = "3.14.2"

// NoShellReason says why wasm boxes have no shell, for the model.
const NoShellReason = "this server's sandbox (wasm backend) runs Python compiled to WebAssembly in Pyodide, with no operating system to start programs in, so there is no shell"

// maxWrite bounds one write_file, as kiln-agent does.
const maxWrite = 32 << 20

// runtimeSlack is what Deno itself (V8, the compiled Pyodide module, its
// threads) needs on top of a box's memory limit; the box's cgroup allows
// it, so that the limit binds Python and not the runtime.
const runtimeSlack = 256 << 20

// runtimePids bounds the threads of one Deno process (V8's and Deno's
// own; code in a wasm box starts none).
const runtimePids = 256

// Options configure the backend. The zero value uses the pinned runtime
// in kiln's cache.
type Options struct {
	// Dir is the cache directory of the pinned runtime (CacheDir).
	Dir string
	// Deno and Pyodide override the installed runtime: a deno binary and
	// a directory holding pyodide.mjs.
	Deno, Pyodide string
	// Wheels is a directory of wheels (pure Python, or built for this
	// Pyodide) every box loads at start, with no network.
	Wheels string
	// Cold starts every box with a full Pyodide load instead of restoring
	// the memory snapshot the backend makes once.
	Cold   bool
	Logger *slog.Logger
}

// Backend makes wasm boxes.
type Backend struct {
	rt         Runtime
	hostDir    string // host.mjs, kernel.mjs and driver.py
	denoDir    string // DENO_DIR: a path that cannot exist
	log        *slog.Logger
	plat       platform
	cold       bool
	wheels     string   // the wheel directory Deno may read; "" for none
	wheelFiles []string // the wheels in it

	smu      sync.Mutex
	snapshot string // the memory snapshot boxes restore; "" until made
	snapErr  error  // why there is none; boxes then start cold

	mu    sync.Mutex
	boxes map[*box]struct{}
}

var (
	_ sandbox.Backend   = (*Backend)(nil)
	_ sandbox.Checker   = (*Backend)(nil)
	_ sandbox.Describer = (*Backend)(nil)
	_ sandbox.Noter     = (*Backend)(nil)
)

// New returns the backend, or ErrNotInstalled when the runtime is missing.
func New(opts Options) (*Backend, error) {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	dir, err := CacheDir(opts.Dir)
	if err != nil {
		return nil, err
	}
	rt := Runtime{Deno: opts.Deno, Pyodide: opts.Pyodide}
	if rt.Deno == "" || rt.Pyodide == "" {
		inst, err := Installed(opts.Dir)
		if err != nil {
			return nil, err
		}
		if rt.Deno == "" {
			rt.Deno = inst.Deno
		}
		if rt.Pyodide == "" {
			rt.Pyodide = inst.Pyodide
		}
	}
	if rt.Pyodide, err = filepath.Abs(rt.Pyodide); err != nil {
		return nil, err
	}
	hostDir, err := writeHost(dir)
	if err != nil {
		return nil, err
	}
	var wheelFiles []string
	if opts.Wheels != "" {
		if opts.Wheels, err = filepath.Abs(opts.Wheels); err != nil {
			return nil, err
		}
		if wheelFiles, err = filepath.Glob(filepath.Join(opts.Wheels, "*.whl")); err != nil || len(wheelFiles) == 0 {
			return nil, fmt.Errorf("--wasm-wheels: no .whl files in %s", opts.Wheels)
		}
	}
	b := &Backend{
		wheels:     opts.Wheels,
		wheelFiles: wheelFiles,
		rt:         rt,
		hostDir:    hostDir,
		// Deno keeps caches (module analysis, V8 code) in DENO_DIR, and
		// writes there whatever modules code makes it load (data: URLs):
		// a path below a file can never be created, so every cache stays
		// in memory and a box writes nothing to the host's disk.
		denoDir: filepath.Join(hostDir, "driver.py", "no-deno-dir"),
		log:     opts.Logger,
		cold:    opts.Cold,
		boxes:   map[*box]struct{}{},
	}
	if err := b.plat.init(b); err != nil {
		return nil, err
	}
	return b, nil
}

// writeHost writes the host scripts and the kernel driver into a directory
// of the cache named by their hash, once, and returns it. Deno may read
// only it and the Pyodide directory.
func writeHost(cache string) (string, error) {
	files := map[string]string{"host.mjs": hostScript, "kernel.mjs": kernelScript, "snapshot.mjs": snapshotScript, "driver.py": kernel.Driver}
	h := sha256.New()
	for _, name := range []string{"host.mjs", "kernel.mjs", "snapshot.mjs", "driver.py"} {
		fmt.Fprintf(h, "%s\x00%d\x00%s", name, len(files[name]), files[name])
	}
	dir := filepath.Join(cache, "host-"+hex.EncodeToString(h.Sum(nil))[:16])
	if _, err := os.Stat(filepath.Join(dir, "driver.py")); err == nil {
		return dir, nil
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", fmt.Errorf("creating %s: %w", cache, err)
	}
	tmp, err := os.MkdirTemp(cache, ".host-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(tmp, name), []byte(content), 0o644); err != nil {
			return "", fmt.Errorf("writing the wasm host scripts: %w", err)
		}
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dir); err != nil {
		if _, serr := os.Stat(filepath.Join(dir, "driver.py")); serr == nil {
			return dir, nil // another kiln wrote it first
		}
		return "", fmt.Errorf("writing the wasm host scripts: %w", err)
	}
	return dir, nil
}

// Name is "wasm".
func (b *Backend) Name() string { return "wasm" }

// Runtime describes what code in a box can use.
func (b *Backend) Runtime() sandbox.Runtime {
	return sandbox.Runtime{
		Python:    PythonVersion + " (Pyodide " + PyodideVersion + ", WebAssembly)",
		NoShell:   NoShellReason,
		Libraries: b.libraries(),
		Notes: []string{
			"Only Python's standard library" + b.wheelNote() + " is available: no pip, no installing packages, no subprocesses or threads, no network.",
		},
	}
}

// libraries are the distributions of the configured wheels.
func (b *Backend) libraries() []string {
	var out []string
	for _, w := range b.wheelFiles {
		name, _, _ := strings.Cut(filepath.Base(w), "-")
		out = append(out, name)
	}
	return out
}

func (b *Backend) wheelNote() string {
	if len(b.wheelFiles) == 0 {
		return ""
	}
	return " and the preinstalled " + strings.Join(b.libraries(), ", ")
}

// Notes are caveats for kiln doctor.
func (b *Backend) Notes() []string {
	n := []string{"Deno " + DenoVersion + ", Pyodide " + PyodideVersion + ": standard library only, no shell"}
	return append(n, b.plat.notes()...)
}

// config is what host.mjs gets as its argument.
type config struct {
	Pyodide  string   `json:"pyodide"`
	Snapshot string   `json:"snapshot,omitempty"`
	Wheels   []string `json:"wheels,omitempty"`
	Driver   string   `json:"driver"`
	Preload  []string `json:"preload"`
	Memory   int64    `json:"memory"`
	FSBytes  int64    `json:"fsBytes"`
	Inodes   int      `json:"inodes"`
	MaxWrite int      `json:"maxWrite"`
	Reseed   string   `json:"reseed"` // Python a box runs first (sandbox.ReseedCode)
	// The box's paths, as every backend's (boxpolicy): the workspace
	// (the code's working directory, which file operations are relative
	// to), HOME and XDG_CACHE_HOME, all in Pyodide's in-memory
	// filesystem.
	Workspace string `json:"workspace"`
	Home      string `json:"home"`
	Cache     string `json:"cache"`
}

// heapMiB is V8's old-space cap for a box with memory limit mem: a
// quarter of it, at least 128 MiB (Pyodide's loader needs about 60).
func heapMiB(mem int64) int64 { return max(128, mem>>20/4) }

// paths are where a Deno process sees what it reads: its own binary, the
// Pyodide directory, the host scripts, the memory snapshot and the wheel
// directory ("" for none). Its confinement (box_linux.go) binds each at a
// path of its own root.
type paths struct {
	deno, pyodide, host, snapshot, wheels string
	out                                   string // a directory it may write; "" for none
}

// hostPaths are those paths on the host.
func (b *Backend) hostPaths(snapshot string) paths {
	return paths{deno: b.rt.Deno, pyodide: b.rt.Pyodide, host: b.hostDir, snapshot: snapshot, wheels: b.wheels}
}

// Args are the deno arguments that start a box, on the paths it sees:
// everything not granted is denied, and nothing is prompted for.
func (b *Backend) args(p paths, l sandbox.Limits, preload []string) []string {
	read := p.pyodide + "," + p.host
	if p.snapshot != "" {
		read += "," + p.snapshot
	}
	var wheels []string
	if p.wheels != "" {
		read += "," + p.wheels
		for _, w := range b.wheelFiles {
			wheels = append(wheels, filepath.Join(p.wheels, filepath.Base(w)))
		}
	}
	cfg, _ := json.Marshal(config{
		Pyodide:  p.pyodide,
		Snapshot: p.snapshot,
		Wheels:   wheels,
		Driver:   filepath.Join(p.host, "driver.py"),
		Preload:  preload,
		Memory:   l.MemoryBytes,
		FSBytes:  l.WorkspaceBytes + l.TmpBytes,
		Inodes:   l.Inodes,
		MaxWrite: maxWrite,
		Reseed:   sandbox.ReseedCode,

		Workspace: boxpolicy.Workspace,
		Home:      boxpolicy.Home,
		Cache:     boxpolicy.Cache,
	})
	return []string{
		"run",
		"--no-prompt",
		"--no-remote",
		"--no-npm",
		"--no-config",
		"--no-lock",
		"--cached-only",
		"--no-code-cache",
		"--quiet",
		"--allow-read=" + read,
		"--v8-flags=--max-old-space-size=" + strconv.FormatInt(heapMiB(l.MemoryBytes), 10),
		filepath.Join(p.host, "host.mjs"),
		string(cfg),
	}
}

// Create starts a box: one Deno process whose host script says hello once
// Pyodide is loaded.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	l := spec.Limits.WithDefaults()
	snap := ""
	if !b.cold {
		snap = b.ensureSnapshot(ctx)
	}
	cmd, opened, err := b.plat.command(b.hostPaths(snap), func(p paths) []string { return b.args(p, l, spec.Preload) })
	if err != nil {
		return nil, fmt.Errorf("confining deno: %w", err)
	}
	defer closeAll(opened)
	inR, stdin, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	stdout, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		stdin.Close()
		return nil, err
	}
	stderr, errW, err := os.Pipe()
	if err != nil {
		for _, f := range []*os.File{inR, stdin, stdout, outW} {
			f.Close()
		}
		return nil, err
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, errW
	bx := &box{b: b, cmd: cmd, exited: make(chan struct{})}
	bx.ctl, err = b.plat.start(cmd, spec.ID, l)
	for _, f := range []*os.File{inR, outW, errW} {
		f.Close()
	}
	if err != nil {
		for _, f := range []*os.File{stdin, stdout, stderr} {
			f.Close()
		}
		return nil, fmt.Errorf("starting deno: %w", err)
	}
	go bx.logStderr(stderr)
	go func() {
		bx.waitErr = cmd.Wait()
		close(bx.exited)
	}()
	b.mu.Lock()
	b.boxes[bx] = struct{}{}
	b.mu.Unlock()
	stream := &pipeStream{r: stdout, w: stdin}
	conn, err := sandbox.DialAgent(ctx, spec.ID, stream, bx.destroy, &sandbox.AgentConnOptions{Logger: b.log})
	if err != nil {
		bx.destroy()
		return nil, fmt.Errorf("starting Pyodide: %w%s", err, bx.lastStderr())
	}
	bx.AgentConn = conn
	return bx, nil
}

// Check starts a box and runs Python in it.
func (b *Backend) Check(ctx context.Context) error {
	bx, err := b.Create(ctx, sandbox.Spec{ID: "check"})
	if err != nil {
		return err
	}
	defer bx.Close()
	res, err := bx.RunPython(ctx, "print('ok')", sandbox.ExecOptions{MaxOutput: 1024})
	if err != nil {
		return fmt.Errorf("running python in a box: %w", err)
	}
	if strings.TrimSpace(res.Stdout.Text) != "ok" {
		return fmt.Errorf("running python in a box: got %q (error %+v)", res.Stdout.Text, res.Error)
	}
	return nil
}

// Close destroys the boxes still open.
func (b *Backend) Close() error {
	b.mu.Lock()
	boxes := make([]*box, 0, len(b.boxes))
	for bx := range b.boxes {
		boxes = append(boxes, bx)
	}
	b.mu.Unlock()
	var errs []error
	for _, bx := range boxes {
		errs = append(errs, bx.Close())
	}
	errs = append(errs, b.plat.close())
	return errors.Join(errs...)
}

// box is one Deno process.
type box struct {
	*sandbox.AgentConn
	b       *Backend
	cmd     *exec.Cmd
	ctl     boxControl
	exited  chan struct{}
	waitErr error

	once sync.Once

	emu    sync.Mutex
	stderr []string // the last lines Deno wrote to stderr
}

// destroy kills the process and undoes what start did.
func (bx *box) destroy() error {
	var err error
	bx.once.Do(func() {
		bx.ctl.kill()
		select {
		case <-bx.exited:
		case <-time.After(10 * time.Second):
			err = errors.New("wasm: deno did not exit after SIGKILL")
		}
		err = errors.Join(err, bx.ctl.release())
		bx.b.mu.Lock()
		delete(bx.b.boxes, bx)
		bx.b.mu.Unlock()
	})
	return err
}

// Close destroys the box; safe to call twice.
func (bx *box) Close() error {
	if bx.AgentConn == nil {
		return bx.destroy()
	}
	return bx.AgentConn.Close()
}

const maxStderrLines = 20

// logStderr logs what Deno writes to stderr (model code can write there
// through js.console): bounded lines, at debug level.
func (bx *box) logStderr(r io.ReadCloser) {
	defer r.Close()
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 4096), 4096)
	for sc.Scan() {
		line := strings.ToValidUTF8(sc.Text(), "?")
		bx.b.log.Debug("deno stderr", "line", line)
		bx.emu.Lock()
		bx.stderr = append(bx.stderr, line)
		if len(bx.stderr) > maxStderrLines {
			bx.stderr = bx.stderr[1:]
		}
		bx.emu.Unlock()
	}
	io.Copy(io.Discard, r)
}

func (bx *box) lastStderr() string {
	bx.emu.Lock()
	defer bx.emu.Unlock()
	if len(bx.stderr) == 0 {
		return ""
	}
	return ": " + strings.Join(bx.stderr, " | ")
}

func closeAll(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// pipeStream is a box's stdout and stdin as one stream.
type pipeStream struct {
	r io.ReadCloser
	w io.WriteCloser
}

func (p *pipeStream) Read(b []byte) (int, error)  { return p.r.Read(b) }
func (p *pipeStream) Write(b []byte) (int, error) { return p.w.Write(b) }
func (p *pipeStream) Close() error {
	return errors.Join(p.w.Close(), p.r.Close())
}

// LimitHits counts the OOM kills of the box's cgroup (Linux); a memory
// bomb inside Pyodide's heap is a MemoryError, not a kill.
func (bx *box) LimitHits() sandbox.LimitHits {
	return sandbox.LimitHits{OOMKills: bx.ctl.oomKills(), PidsRefused: -1}
}

var _ sandbox.LimitReporter = (*box)(nil)

// Leftovers lists the boxes of this backend that are not destroyed yet,
// with their Deno processes: after every box is closed, none.
func (b *Backend) Leftovers() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for bx := range b.boxes {
		pid := 0
		if bx.cmd.Process != nil {
			pid = bx.cmd.Process.Pid
		}
		out = append(out, fmt.Sprintf("wasm box deno pid %d", pid))
	}
	return out
}
