package gvisor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"time"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// Backend starts boxes under runsc. Create it with New; Close it when the
// server exits to destroy every box it still holds.
type Backend struct {
	opts    Options
	log     *slog.Logger
	runsc   string
	version string
	dir     string // this process's state directory
	root    string // the boxes' root directory

	mu        sync.Mutex
	boxes     map[string]*box
	templates map[string]*template
	closed    bool
}

// New checks the runsc and agent binaries, prepares the state directory
// (destroying what dead kiln processes left there) and, for the host
// runtime view, synthesizes the boxes' root. It builds the pinned runsc
// first when opts.Runsc is empty and the cache has none.
func New(opts Options) (*Backend, error) {
	opts = opts.withDefaults()
	if opts.Agent == "" {
		return nil, errors.New("gvisor backend: no kiln-agent binary given")
	}
	if opts.UID == 0 || opts.GID == 0 {
		return nil, errors.New("gvisor backend: boxes never run as root")
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("gvisor backend: needs root (runsc creates namespaces and cgroups)")
	}
	agent, err := filepath.Abs(opts.Agent)
	if err != nil {
		return nil, fmt.Errorf("resolving agent path: %w", err)
	}
	if err := checkStaticAgent(agent); err != nil {
		return nil, err
	}
	opts.Agent = agent
	runsc := opts.Runsc
	if runsc == "" {
		if runsc, err = EnsureRunsc(context.Background(), opts.Logger); err != nil {
			return nil, err
		}
	}
	if err := CheckStatic(runsc); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	version, err := runscVersion(ctx, runsc)
	if err != nil {
		return nil, err
	}
	b := &Backend{
		opts:      opts,
		log:       opts.Logger.With("backend", "gvisor"),
		runsc:     runsc,
		version:   version,
		boxes:     make(map[string]*box),
		templates: make(map[string]*template),
	}
	if err := b.prepareState(); err != nil {
		return nil, err
	}
	if opts.Rootfs != "" {
		if b.root, err = filepath.Abs(opts.Rootfs); err != nil {
			return nil, fmt.Errorf("resolving rootfs path: %w", err)
		}
	} else {
		b.root = filepath.Join(b.dir, "rootfs")
		if err := buildHostRoot(b.root, opts.UID, opts.GID); err != nil {
			os.RemoveAll(b.dir)
			return nil, err
		}
	}
	b.log.Info("gvisor backend ready", "runsc", runsc, "version", version, "platform", opts.Platform, "state", b.dir)
	return b, nil
}

func checkStaticAgent(path string) error {
	if err := CheckStatic(path); err != nil {
		if errors.Is(err, ErrDynamicRunsc) {
			return fmt.Errorf("%s is dynamically linked; build kiln-agent with CGO_ENABLED=0", path)
		}
		return fmt.Errorf("checking kiln-agent: %w", err)
	}
	return nil
}

// Info describes the runsc in use.
func (b *Backend) Info() Info {
	return Info{Runsc: b.runsc, Version: b.version, Platform: b.opts.Platform, Rootfs: b.opts.Rootfs, StateDir: b.dir, Warm: !b.opts.Cold}
}

// boxPython is the python the agent runs in a box (its default).
const boxPython = "/usr/bin/python3"

// Runtime describes the python inside boxes. With the host runtime view it
// is the host's python, asked directly; an image root's python is not run
// from outside, so it is not described.
func (b *Backend) Runtime() sandbox.Runtime {
	if b.opts.Rootfs != "" {
		return sandbox.Runtime{}
	}
	return sandbox.HostRuntime(boxPython)
}

// Create starts a box. With warm start it restores the box from the
// template of its shape when that template is ready, and starts building
// the template in the background when there is none yet.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	if spec.ID == "" {
		return nil, errors.New("creating gvisor box: empty sandbox ID")
	}
	s := b.spec(spec)
	if !b.opts.Cold {
		t, fresh := b.template(s, spec)
		if fresh {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
				defer cancel()
				b.buildTemplate(ctx, t, s)
			}()
		} else if t.isReady() && t.err == nil {
			sb, err := b.restore(ctx, spec.ID, s, t)
			if err == nil {
				return sb, nil
			}
			if ctx.Err() != nil {
				return nil, err
			}
			b.log.Warn("restoring box failed; starting it cold", "id", spec.ID, "err", err)
		}
	}
	return b.coldStart(ctx, spec.ID, s)
}

// Warm builds the template for boxes created with spec's limits and
// preloads, so that the next Create restores instead of booting. It is
// what a server calls at start; Create builds templates lazily otherwise.
func (b *Backend) Warm(ctx context.Context, spec sandbox.Spec) error {
	if b.opts.Cold {
		return nil
	}
	s := b.spec(spec)
	t, fresh := b.template(s, spec)
	if fresh {
		b.buildTemplate(ctx, t, s)
	}
	select {
	case <-t.ready:
		return t.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// spec is the OCI spec of a box; its cgroup path is filled in per box.
func (b *Backend) spec(spec sandbox.Spec) boxSpec {
	cfg := boxConfig{
		Root:    b.root,
		Agent:   b.opts.Agent,
		Limits:  spec.Limits.WithDefaults(),
		Preload: spec.Preload,
		UID:     b.opts.UID,
		GID:     b.opts.GID,
	}
	if b.opts.Rootfs == "" {
		cfg.HostDirs = presentHostDirs()
	}
	return boxSpec{cfg}
}

type boxSpec struct{ boxConfig }

func (s boxSpec) forBox(cid string) boxConfig {
	c := s.boxConfig
	c.CgroupPath = cgroupParent + "/" + cid
	return c
}

// coldStart boots a box and waits for its agent's hello.
func (b *Backend) coldStart(ctx context.Context, id string, s boxSpec) (sandbox.Sandbox, error) {
	cid := containerID(id) + "-" + randSuffix()
	bx, stream, err := b.start(ctx, cid, s.forBox(cid), "")
	if err != nil {
		return nil, err
	}
	conn, err := sandbox.NewAgentConn(ctx, id, stream, bx.destroy)
	if err != nil {
		return nil, bx.explain(fmt.Errorf("starting gvisor box: %w", err))
	}
	b.log.Debug("box started cold", "id", id, "container", cid)
	return conn, nil
}

// restore starts a box from t's checkpoint. The restored agent does not
// say hello again: a ping proves it answers, and the template's hello is
// replayed to the connection.
func (b *Backend) restore(ctx context.Context, id string, s boxSpec, t *template) (sandbox.Sandbox, error) {
	cid := containerID(id) + "-" + randSuffix()
	bx, stream, err := b.start(ctx, cid, s.forBox(cid), t.image)
	if err != nil {
		return nil, err
	}
	fail := func(err error) error {
		stream.Close()
		bx.destroy()
		return bx.explain(fmt.Errorf("restoring gvisor box: %w", err))
	}
	const pingID = math.MaxUint64
	if err := agentproto.WriteFrame(stream, &agentproto.Request{ID: pingID, Op: agentproto.OpPing}); err != nil {
		return nil, fail(fmt.Errorf("pinging agent: %w", err))
	}
	var resp agentproto.Response
	if err := readFrame(ctx, stream, &resp); err != nil {
		return nil, fail(fmt.Errorf("pinging agent: %w", err))
	}
	if resp.ID != pingID || resp.Error != "" {
		return nil, fail(fmt.Errorf("pinging agent: unexpected answer %+v", resp))
	}
	var hello bytes.Buffer
	if err := agentproto.WriteFrame(&hello, &t.hello); err != nil {
		return nil, fail(err)
	}
	conn, err := sandbox.NewAgentConn(ctx, id, &replayStream{r: io.MultiReader(&hello, stream), stream: stream}, bx.destroy)
	if err != nil {
		return nil, bx.explain(fmt.Errorf("restoring gvisor box: %w", err))
	}
	if t.hello.Python != "" {
		// Every box restored from one image starts with the same random
		// state; draw fresh seeds from the (host) entropy source.
		if _, err := conn.RunPython(ctx, sandbox.ReseedCell, sandbox.ExecOptions{MaxOutput: 4096}); err != nil {
			conn.Close()
			return nil, fmt.Errorf("reseeding restored box: %w", err)
		}
	}
	b.log.Debug("box restored", "id", id, "container", cid, "template", t.key)
	return conn, nil
}

// replayStream reads from r (a replayed hello, then the stream) and writes
// to and closes the stream.
type replayStream struct {
	r      io.Reader
	stream io.ReadWriteCloser
}

func (s *replayStream) Read(p []byte) (int, error)  { return s.r.Read(p) }
func (s *replayStream) Write(p []byte) (int, error) { return s.stream.Write(p) }
func (s *replayStream) Close() error                { return s.stream.Close() }

// readFrame reads one frame, giving up when ctx ends (the caller then
// destroys the box, which unblocks the read).
func readFrame(ctx context.Context, r io.Reader, v any) error {
	errc := make(chan error, 1)
	go func() { errc <- agentproto.ReadFrame(r, v) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		if c, ok := r.(io.Closer); ok {
			c.Close()
		}
		<-errc
		return ctx.Err()
	}
}

// template is the checkpoint of a warmed box of one shape.
type template struct {
	key   string
	dir   string
	image string
	ready chan struct{} // closed when image and hello, or err, are set
	hello agentproto.Hello
	err   error
}

func (t *template) isReady() bool {
	select {
	case <-t.ready:
		return true
	default:
		return false
	}
}

// template returns the template for boxes of spec s, and whether the caller
// has just registered it and must build it.
func (b *Backend) template(s boxSpec, spec sandbox.Spec) (*template, bool) {
	key := templateKey(buildSpec(s.forBox("template")), b.version, b.opts.Platform, fileStamp(b.opts.Agent))
	b.mu.Lock()
	defer b.mu.Unlock()
	if t, ok := b.templates[key]; ok {
		return t, false
	}
	dir := filepath.Join(b.dir, "templates", key)
	t := &template{key: key, dir: dir, image: filepath.Join(dir, "image"), ready: make(chan struct{})}
	b.templates[key] = t
	return t, true
}

// buildTemplate boots a box, waits until its agent has imported its
// preloads, and checkpoints it. The box exits with the checkpoint.
func (b *Backend) buildTemplate(ctx context.Context, t *template, s boxSpec) {
	start := time.Now()
	t.err = b.checkpoint(ctx, t, s)
	if t.err != nil {
		b.log.Warn("building warm-start template failed; boxes of this shape start cold", "template", t.key, "err", t.err)
	} else {
		b.log.Info("warm-start template ready", "template", t.key, "took", time.Since(start).Round(time.Millisecond), "python", t.hello.Python, "preloaded", t.hello.Preloaded)
	}
	close(t.ready)
}

func (b *Backend) checkpoint(ctx context.Context, t *template, s boxSpec) error {
	cid := "kiln-template-" + t.key + "-" + randSuffix()
	bx, stream, err := b.start(ctx, cid, s.forBox(cid), "")
	if err != nil {
		return err
	}
	defer func() {
		stream.Close()
		bx.destroy()
	}()
	if err := readFrame(ctx, stream, &t.hello); err != nil {
		return bx.explain(fmt.Errorf("waiting for template agent: %w", err))
	}
	if t.hello.Error != "" {
		return fmt.Errorf("template agent: %s", t.hello.Error)
	}
	if err := os.MkdirAll(t.image, 0o700); err != nil {
		return fmt.Errorf("creating checkpoint directory: %w", err)
	}
	if out, err := b.runscCmd(ctx, bx.state, "checkpoint", "--image-path="+t.image, cid).CombinedOutput(); err != nil {
		return fmt.Errorf("checkpointing template: %w: %s", err, tail(string(out), 1000))
	}
	select {
	case <-bx.exited:
	case <-ctx.Done():
		return fmt.Errorf("waiting for checkpointed template to exit: %w", ctx.Err())
	}
	return nil
}

// Check reports whether a box starts and runs a command (kiln doctor).
func (b *Backend) Check(ctx context.Context) error {
	if err := CheckStatic(b.runsc); err != nil {
		return err
	}
	if _, err := runscVersion(ctx, b.runsc); err != nil {
		return err
	}
	sb, err := b.coldStart(ctx, "doctor-"+randSuffix(), b.spec(sandbox.Spec{}))
	if err != nil {
		return fmt.Errorf("starting a gvisor box (runsc %s, platform %s): %w", b.version, b.opts.Platform, err)
	}
	defer sb.Close()
	res, err := sb.RunShell(ctx, "echo ok", sandbox.ExecOptions{MaxOutput: 1024})
	if err != nil {
		return fmt.Errorf("running a command in a gvisor box: %w", err)
	}
	if strings.TrimSpace(res.Stdout.Text) != "ok" {
		return fmt.Errorf("running a command in a gvisor box: got %q (exit %d, stderr %q)", res.Stdout.Text, res.ExitCode, res.Stderr.Text)
	}
	return nil
}

// Close destroys every box and template of this backend and removes its
// state directory.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	boxes := make([]*box, 0, len(b.boxes))
	for _, bx := range b.boxes {
		boxes = append(boxes, bx)
	}
	b.mu.Unlock()
	var errs []error
	for _, bx := range boxes {
		bx.closeStream()
		errs = append(errs, bx.destroy())
	}
	errs = append(errs, removeState(b.dir))
	removeCgroup(cgroupParent) // only if empty: other kiln processes may use it
	return errors.Join(errs...)
}

func fileStamp(path string) string {
	fi, err := os.Stat(path)
	if err != nil {
		return path
	}
	return path + "@" + strconv.FormatInt(fi.Size(), 10) + "@" + strconv.FormatInt(fi.ModTime().UnixNano(), 10)
}

func randSuffix() string {
	var b [6]byte
	if _, err := io.ReadFull(randReader, b[:]); err != nil {
		panic(err)
	}
	const hex = "0123456789abcdef"
	out := make([]byte, 0, 12)
	for _, c := range b {
		out = append(out, hex[c>>4], hex[c&15])
	}
	return string(out)
}
