package gvisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"time"

	"kiln/internal/agentproto"
	"kiln/internal/boxtemplate"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// Backend starts boxes under runsc. Create it with New; Close it when the
// server exits to destroy every box it still holds.
type Backend struct {
	opts    Options
	log     *slog.Logger
	runsc   string
	version string
	dir     string // this process's state directory
	// sharedRoot is runsc's --shared-root for every box, under dir.
	sharedRoot string
	root       string // the boxes' root directory
	owner      string // stamp of this process, in its boxes' cgroup names
	cgroups    *boxkit.Cgroups

	tpls *boxkit.TemplateCache[*template]

	mu     sync.Mutex
	boxes  map[string]*box
	closed bool
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
	if err := prepareTemplate(&opts); err != nil {
		return nil, err
	}
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
		opts:    opts,
		log:     opts.Logger.With("backend", "gvisor"),
		runsc:   runsc,
		version: version,
		boxes:   make(map[string]*box),
		owner:   selfOwner().String(),
		cgroups: boxkit.HostCgroups(),
	}
	b.tpls = boxkit.NewTemplateCache(boxkit.TemplateOptions[*template]{
		Name:        "warm-start template",
		KeepFailure: retryTemplate,
		Logger:      b.log,
	})
	if err := b.prepareState(); err != nil {
		return nil, err
	}
	if opts.Rootfs != "" {
		if b.root, err = filepath.Abs(opts.Rootfs); err != nil {
			return nil, fmt.Errorf("resolving rootfs path: %w", err)
		}
		if opts.Template != "" {
			if err := checkTemplateMountPoint(b.root); err != nil {
				os.RemoveAll(b.dir)
				return nil, err
			}
		}
	} else {
		b.root = filepath.Join(b.dir, "rootfs")
		if err := buildHostRoot(b.root, opts.UID, opts.GID); err != nil {
			os.RemoveAll(b.dir)
			return nil, err
		}
		if opts.Template != "" {
			if err := templateMountPoint(b.root); err != nil {
				os.RemoveAll(b.dir)
				return nil, err
			}
		}
	}
	if err := b.prepareEgressRoot(); err != nil {
		os.RemoveAll(b.dir)
		return nil, err
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
	if b.opts.TemplateWritable {
		// The setup's box alone may write the template's files: they are
		// its code user's (boxtemplate.Stage), whose files the gofer
		// makes in the box's name.
		if err := boxtemplate.HandTo(b.opts.Template, int(b.opts.UID), int(b.opts.GID)); err != nil {
			return nil, err
		}
	}
	if !b.opts.Cold {
		if tt := b.tpls.Ready(b.templateKey(s), b.buildTemplate(s)); tt != nil {
			sb, err := b.restore(ctx, spec.ID, s, tt.Value)
			b.tpls.Release(tt)
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
	return b.tpls.Warm(ctx, b.templateKey(s), b.buildTemplate(s))
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

		Template:   b.opts.Template,
		TemplateRW: b.opts.TemplateWritable,
	}
	if b.opts.Rootfs == "" {
		cfg.HostDirs = presentHostDirs()
	}
	return boxSpec{cfg, b.owner}
}

type boxSpec struct {
	boxConfig
	owner string // stamp of this process
}

func (s boxSpec) forBox(cid string) boxConfig {
	c := s.boxConfig
	c.CgroupPath = CgroupParent + "/" + s.owner + "." + cid
	return c
}

// coldStart boots a box and waits for its agent's hello.
func (b *Backend) coldStart(ctx context.Context, id string, s boxSpec) (sandbox.Sandbox, error) {
	cid := containerID(id) + "-" + randSuffix()
	bx, stream, err := b.start(ctx, id, cid, s.forBox(cid), "")
	if err != nil {
		return nil, err
	}
	conn, err := sandbox.NewAgentConn(ctx, id, stream, bx.destroy)
	if err != nil {
		return nil, bx.explain(fmt.Errorf("starting gvisor box: %w", err))
	}
	if err := bx.checkNetTaken(); err != nil {
		conn.Close()
		return nil, fmt.Errorf("starting gvisor box: %w", err)
	}
	b.log.Debug("box started cold", "id", id, "container", cid)
	return &gvBox{conn, bx}, nil
}

// restore starts a box from t's checkpoint. The restored agent does not
// say hello again: a ping proves it answers, and the template's hello is
// replayed to the connection.
func (b *Backend) restore(ctx context.Context, id string, s boxSpec, t *template) (sandbox.Sandbox, error) {
	cid := containerID(id) + "-" + randSuffix()
	bx, stream, err := b.start(ctx, id, cid, s.forBox(cid), t.image)
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
	if err := bx.checkNetTaken(); err != nil {
		return nil, fail(err)
	}
	// Every box restored from one image starts with the same random
	// state; RestoreConn draws fresh seeds from the (host) entropy source.
	conn, err := sandbox.RestoreConn(ctx, id, stream, t.hello, bx.destroy, nil)
	if err != nil {
		return nil, bx.explain(fmt.Errorf("restoring gvisor box: %w", err))
	}
	b.log.Debug("box restored", "id", id, "container", cid, "template", t.key)
	return &gvBox{conn, bx}, nil
}

// gvBox is a box's agent connection with what the host sees of its
// limits.
type gvBox struct {
	*sandbox.AgentConn
	bx *box
}

var _ sandbox.LimitReporter = (*gvBox)(nil)

// A gVisor box saves and loads state-level snapshots through its agent.
var (
	_ sandbox.Snapshotter = (*gvBox)(nil)
	_ sandbox.StateLoader = (*gvBox)(nil)
)

// LimitHits counts the OOM kills of the box's host cgroup: gVisor has no
// OOM killer of its own, so a box over its limit dies whole. runsc removes
// the cgroup as the box dies, mostly before the host reads the count: the
// count is then unknown (-1) and the result says so. Its pids limit is the RLIMIT_NPROC the gVisor kernel enforces
// inside, which the host does not see (the host cgroup's pids limit has
// slack for the sandbox's own threads).
func (g *gvBox) LimitHits() sandbox.LimitHits {
	if g.bx.cgroup == "" {
		return sandbox.LimitHits{OOMKills: -1, PidsRefused: -1}
	}
	return sandbox.LimitHits{OOMKills: g.bx.b.cgroups.Group(g.bx.cgroup).OOMKills(), PidsRefused: -1}
}

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
	hello agentproto.Hello
}

// retryTemplate is how long boxes of a shape whose template could not be
// built start cold before the template is tried again.
const retryTemplate = time.Minute

// templateKey names the template for boxes of spec s.
func (b *Backend) templateKey(s boxSpec) string {
	return templateKey(buildSpec(s.forBox("template")), b.version, b.opts.Platform, fileStamp(b.opts.Agent), "network="+b.network())
}

// buildTemplate boots a box, waits until its agent has imported its
// preloads, and checkpoints it. The box exits with the checkpoint.
func (b *Backend) buildTemplate(s boxSpec) boxkit.TemplateBuild[*template] {
	return func(ctx context.Context, _ bool) (*template, time.Time, error) {
		key := b.templateKey(s)
		dir := filepath.Join(b.dir, "templates", key)
		t := &template{key: key, dir: dir, image: filepath.Join(dir, "image")}
		start := time.Now()
		ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		if err := b.checkpoint(ctx, t, s); err != nil {
			b.log.Warn("building warm-start template failed; boxes of this shape start cold", "template", t.key, "err", err)
			return nil, time.Time{}, err
		}
		b.log.Info("warm-start template ready", "template", t.key, "took", time.Since(start).Round(time.Millisecond), "python", t.hello.Python, "preloaded", t.hello.Preloaded)
		return t, time.Time{}, nil
	}
}

func (b *Backend) checkpoint(ctx context.Context, t *template, s boxSpec) error {
	cid := templatePrefix + t.key + "-" + randSuffix()
	bx, stream, err := b.start(ctx, "template-"+t.key, cid, s.forBox(cid), "")
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
	if err := sandbox.Probe(ctx, sb); err != nil {
		return fmt.Errorf("gvisor: %w", err)
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
	b.tpls.Close() // a template being built fails now that the backend is closed
	errs = append(errs, removeState(b.dir))
	b.cgroups.Group(CgroupParent).RemoveIfEmpty() // other kiln processes may use it
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
