package microvm

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/agentproto"
	"kiln/internal/guestinit"
	"kiln/internal/sandbox"
)

// Backend creates microVM boxes. It is safe for concurrent use.
type Backend struct {
	opts  Options
	log   *slog.Logger
	notes []string

	mu        sync.Mutex
	templates map[string]*template
	live      map[*vm]struct{}
	closed    bool
	tscKHz    int64 // TCG only: the guest's TSC rate, see kernelCmdline
}

// New checks opts and returns the backend. It does not boot anything:
// templates are made on first use (or by Prepare).
func New(opts Options) (*Backend, error) {
	if opts.Image == nil {
		return nil, ErrNoImage
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.QEMU == "" {
		opts.QEMU = "qemu-system-x86_64"
	}
	q, err := exec.LookPath(opts.QEMU)
	if err != nil {
		return nil, ErrNoQEMU
	}
	opts.QEMU = q
	switch opts.Accel {
	case "":
		opts.Accel = AccelKVM
	case AccelKVM, AccelTCG:
	default:
		return nil, ErrBadAccel
	}
	if os.Geteuid() != 0 {
		opts.NoCgroup, opts.NoNamespaces = true, true
	}
	if opts.BootTimeout == 0 {
		opts.BootTimeout = time.Minute
		if opts.Accel == AccelTCG {
			opts.BootTimeout = 5 * time.Minute
		}
	}
	if err := vmmDirs("microvm", &opts.StateDir, &opts.RunDir, &opts.Cgroup); err != nil {
		return nil, err
	}
	removeOrphans(opts.Cgroup)
	b := &Backend{
		opts:      opts,
		log:       opts.Logger.With("backend", "microvm", "accel", opts.Accel),
		templates: map[string]*template{},
		live:      map[*vm]struct{}{},
	}
	if opts.Accel == AccelTCG {
		if ci, err := os.ReadFile("/proc/cpuinfo"); err == nil {
			b.tscKHz = hostTSCKHz(string(ci))
		}
		b.notes = append(b.notes, "microvm: running under TCG software emulation: slow, and NOT a security boundary (development only)")
	}
	if opts.NoCgroup {
		b.notes = append(b.notes, "microvm: QEMU runs without its own cgroup (not root)")
	}
	for _, n := range b.notes {
		b.log.Warn(n)
	}
	return b, nil
}

// Check implements sandbox.Checker: the image's files exist, QEMU runs,
// and under KVM /dev/kvm opens.
func (b *Backend) Check(ctx context.Context) error {
	for _, p := range []string{b.opts.Image.KernelPath(), b.opts.Image.InitrdPath(), b.opts.Image.RootfsPath()} {
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("checking image: %w", err)
		}
	}
	out, err := exec.CommandContext(ctx, b.opts.QEMU, "-version").Output()
	if err != nil {
		return fmt.Errorf("running %s: %w", b.opts.QEMU, err)
	}
	if !bytes.Contains(out, []byte("QEMU")) {
		return fmt.Errorf("running %s: not QEMU", b.opts.QEMU)
	}
	if b.opts.Accel == AccelKVM {
		f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("%w: %v", ErrNoKVM, err)
		}
		f.Close()
	}
	return nil
}

// Create starts a box: a clone restored from the template for spec's shape
// (booting the template first if needed), or a cold boot with ColdBoot.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	limits := spec.Limits.WithDefaults()
	preload := cleanPreload(spec.Preload)
	id := spec.ID
	if id == "" {
		id = randomID()
	}
	cfg := b.vmConfig(limits, preload)
	if b.opts.ColdBoot {
		return b.coldBoot(ctx, id, cfg, limits)
	}
	tpl, err := b.template(ctx, cfg, limits)
	if err != nil {
		return nil, err
	}
	sb, err := b.restore(ctx, id, tpl, limits)
	if err != nil && ctx.Err() == nil && !tpl.fresh {
		// A template saved by an earlier run may not load (a QEMU
		// upgrade that kept its mtime, a damaged file): make it again.
		b.log.Warn("restoring saved template failed; making it again", "err", err)
		b.dropTemplate(tpl)
		if tpl, err = b.template(ctx, cfg, limits); err != nil {
			return nil, err
		}
		sb, err = b.restore(ctx, id, tpl, limits)
	}
	return sb, err
}

// Prepare makes (or loads) the template for spec's shape now, so that the
// first Create does not wait for a boot. Servers call it at start.
func (b *Backend) Prepare(ctx context.Context, spec sandbox.Spec) error {
	limits := spec.Limits.WithDefaults()
	_, err := b.template(ctx, b.vmConfig(limits, cleanPreload(spec.Preload)), limits)
	return err
}

// Close kills every live VM and removes the run directory. Templates stay
// in StateDir for the next run.
func (b *Backend) Close() error {
	b.mu.Lock()
	b.closed = true
	live := b.live
	b.live = map[*vm]struct{}{}
	b.mu.Unlock()
	var errs []error
	for v := range live {
		errs = append(errs, v.destroy())
	}
	if !b.opts.Verbose {
		errs = append(errs, os.RemoveAll(b.opts.RunDir))
	}
	return errors.Join(errs...)
}

func (b *Backend) vmConfig(l sandbox.Limits, preload []string) vmConfig {
	mem, cpus := guestShape(l)
	im := b.opts.Image
	return vmConfig{
		QEMU:      b.opts.QEMU,
		Accel:     b.opts.Accel,
		MemoryMiB: mem,
		CPUs:      cpus,
		Kernel:    im.KernelPath(),
		Initrd:    im.InitrdPath(),
		Rootfs:    im.RootfsPath(),
		Cmdline:   kernelCmdline(l, preload, b.opts.Verbose, b.tscKHz),
		Seccomp:   !b.opts.NoSeccomp,
	}
}

// qemuLimits are the cgroup limits of one QEMU process: guest RAM plus the
// VMM's own overhead (TCG's translation cache is the larger part of it).
func (b *Backend) qemuLimits(cfg vmConfig, l sandbox.Limits) cgroupLimits {
	overhead := int64(192 << 20)
	if cfg.Accel == AccelTCG {
		overhead += 256 << 20
	}
	return cgroupLimits{MemoryBytes: cfg.MemoryMiB<<20 + overhead, Pids: 128, CPUs: l.CPUs}
}

// coldBoot boots a fresh VM and waits for its agent.
func (b *Backend) coldBoot(ctx context.Context, id string, cfg vmConfig, l sandbox.Limits) (sandbox.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, b.opts.BootTimeout)
	defer cancel()
	v, err := b.start(ctx, id, cfg, l, nil)
	if err != nil {
		return nil, fmt.Errorf("booting vm: %w", err)
	}
	sb, err := sandbox.NewAgentConn(ctx, id, v.agent, v.destroy)
	if err != nil {
		return nil, fmt.Errorf("booting vm: %w%s", err, v.consoleTail())
	}
	return sb, nil
}

// restore starts a clone of tpl and hands out its agent. The clone's agent
// said hello in the template already; the saved frame is replayed.
func (b *Backend) restore(ctx context.Context, id string, tpl *template, l sandbox.Limits) (sandbox.Sandbox, error) {
	state, err := os.Open(tpl.statePath())
	if err != nil {
		return nil, fmt.Errorf("restoring vm: %w", err)
	}
	defer state.Close()
	cfg := tpl.cfg
	cfg.MemFile = tpl.memPath()
	cfg.MemShared = false
	cfg.Incoming = true
	v, err := b.start(ctx, id, cfg, l, state)
	if err != nil {
		return nil, fmt.Errorf("restoring vm: %w", err)
	}
	steps := []step{
		{"set migration capabilities", func(ctx context.Context) error {
			return v.qmp.setMigrationCaps(ctx, "x-ignore-shared")
		}},
		{"load state", func(ctx context.Context) error {
			return v.qmp.migrateIncoming(ctx, fmt.Sprintf("fd:%d", fdState))
		}},
		{"wait loaded", v.waitMigrated},
		// The template was paused when saved, so the clone is too.
		{"resume", v.qmp.cont},
		{"reseed guest", v.reseed},
	}
	if err := runSteps(ctx, v.log, steps); err != nil {
		v.destroy()
		return nil, fmt.Errorf("restoring vm: %w%s", err, v.consoleTail())
	}
	stream := &replayStream{r: io.MultiReader(bytes.NewReader(tpl.hello), v.agent), Conn: v.agent}
	sb, err := sandbox.NewAgentConn(ctx, id, stream, v.destroy)
	if err != nil {
		return nil, fmt.Errorf("restoring vm: %w", err)
	}
	// Clones share the template's memory, Python's random state included.
	if _, err := sb.RunPython(ctx, sandbox.ReseedCell, sandbox.ExecOptions{MaxOutput: 4096}); err != nil {
		sb.Close()
		return nil, fmt.Errorf("reseeding restored vm: %w", err)
	}
	return sb, nil
}

// replayStream reads a saved hello frame, then the agent.
type replayStream struct {
	r io.Reader
	net.Conn
}

func (s *replayStream) Read(p []byte) (int, error) { return s.r.Read(p) }

// step is one named part of booting or restoring a VM, logged and timed.
type step struct {
	name string
	fn   func(context.Context) error
}

func runSteps(ctx context.Context, log *slog.Logger, steps []step) error {
	for _, s := range steps {
		start := time.Now()
		if err := s.fn(ctx); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		log.Debug("vm step", "step", s.name, "took", time.Since(start))
	}
	return nil
}

// vm is one running QEMU process.
type vm struct {
	id    string
	dir   string
	log   *slog.Logger
	cmd   *exec.Cmd
	agent net.Conn
	seed  net.Conn
	qmp   *qmp

	exited  chan struct{}
	stderr  *bytes.Buffer
	cleanup []func() error // LIFO
	once    sync.Once
	err     error
}

// start spawns QEMU for cfg with its sockets, in its own cgroup and
// namespaces, and connects QMP. state is passed as the migration fd.
func (b *Backend) start(ctx context.Context, id string, cfg vmConfig, l sandbox.Limits, state *os.File) (_ *vm, err error) {
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, sandbox.ErrClosed
	}
	v := &vm{id: id, dir: filepath.Join(b.opts.RunDir, id), log: b.log.With("vm", id), exited: make(chan struct{}), stderr: new(bytes.Buffer)}
	defer func() {
		if err != nil {
			v.destroy()
		}
	}()
	if !b.opts.Verbose { // verbose keeps console logs for debugging
		v.defer_(func() error { return os.RemoveAll(v.dir) })
	}
	if err := os.Mkdir(v.dir, 0o700); err != nil {
		return nil, err
	}
	cfg.Console = filepath.Join(v.dir, "console.log")

	agentHost, agentChild, err := socketpair()
	if err != nil {
		return nil, err
	}
	v.agent = agentHost
	v.defer_(closer(agentHost))
	qmpHost, qmpChild, err := socketpair()
	if err != nil {
		agentChild.Close()
		return nil, err
	}
	v.defer_(closer(qmpHost))
	seedHost, seedChild, err := socketpair()
	if err != nil {
		agentChild.Close()
		qmpChild.Close()
		return nil, err
	}
	v.seed = seedHost
	v.defer_(closer(seedHost))

	cmd := exec.Command(cfg.QEMU, cfg.args()...)
	cmd.ExtraFiles = []*os.File{agentChild, qmpChild, seedChild}
	if state != nil {
		cmd.ExtraFiles = append(cmd.ExtraFiles, state)
	}
	cmd.Stdout = v.stderr
	cmd.Stderr = v.stderr
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if !b.opts.NoNamespaces {
		cmd.SysProcAttr.Cloneflags = unix.CLONE_NEWNET | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS | unix.CLONE_NEWNS | unix.CLONE_NEWPID
	}
	var cg *cgroup
	if !b.opts.NoCgroup {
		if cg, err = newCgroup(b.opts.Cgroup, id, b.qemuLimits(cfg, l)); err != nil {
			agentChild.Close()
			qmpChild.Close()
			seedChild.Close()
			return nil, err
		}
		v.defer_(cg.remove)
	}
	v.log.Debug("starting qemu", "args", strings.Join(cfg.args(), " "))
	err = cmd.Start()
	agentChild.Close()
	qmpChild.Close()
	seedChild.Close()
	if err != nil {
		return nil, fmt.Errorf("starting qemu: %w", err)
	}
	v.cmd = cmd
	v.defer_(func() error {
		cmd.Process.Kill()
		<-v.exited
		return nil
	})
	go func() {
		cmd.Wait()
		close(v.exited)
	}()
	if cg != nil {
		if err := cg.add(cmd.Process.Pid); err != nil {
			return nil, err
		}
	}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, sandbox.ErrClosed
	}
	b.live[v] = struct{}{}
	b.mu.Unlock()
	v.defer_(func() error {
		b.mu.Lock()
		delete(b.live, v)
		b.mu.Unlock()
		return nil
	})
	if v.qmp, err = dialQMP(ctx, qmpHost); err != nil {
		return nil, fmt.Errorf("%w%s", err, v.consoleTail())
	}
	return v, nil
}

func (v *vm) defer_(f func() error) { v.cleanup = append(v.cleanup, f) }

// closer closes c, which its user may have closed already.
func closer(c io.Closer) func() error {
	return func() error {
		if err := c.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			return err
		}
		return nil
	}
}

// destroy kills QEMU and undoes everything start did, once.
func (v *vm) destroy() error {
	v.once.Do(func() {
		var errs []error
		for i := len(v.cleanup) - 1; i >= 0; i-- {
			errs = append(errs, v.cleanup[i]())
		}
		v.err = errors.Join(errs...)
	})
	return v.err
}

// reseed sends the guest fresh entropy and the time, and waits for
// guestinit to have reseeded the kernel's RNG and set the clock: without
// it every clone of a template would draw the same random numbers until
// the kernel reseeded by itself, and under KVM its clock would stand at
// the template's save time.
func (v *vm) reseed(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { v.seed.Close() })
	defer stop()
	seed := make([]byte, guestinit.SeedMessageSize)
	rand.Read(seed[:guestinit.SeedSize])
	binary.BigEndian.PutUint64(seed[guestinit.SeedSize:], uint64(time.Now().UnixNano()))
	if _, err := v.seed.Write(seed); err != nil {
		return errors.Join(err, ctx.Err())
	}
	if _, err := io.ReadFull(v.seed, seed[:1]); err != nil {
		return errors.Join(err, ctx.Err())
	}
	return nil
}

// waitMigrated polls QMP until the incoming state has loaded.
func (v *vm) waitMigrated(ctx context.Context) error {
	for {
		mi, err := v.qmp.queryMigrate(ctx)
		if err != nil {
			return err
		}
		switch mi.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("loading state: %s %s", mi.Status, mi.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-v.exited:
			return fmt.Errorf("qemu exited: %s", strings.TrimSpace(v.stderr.String()))
		case <-time.After(time.Millisecond):
		}
	}
}

// consoleTail is the end of the guest console and QEMU's stderr, for
// errors.
func (v *vm) consoleTail() string {
	var s strings.Builder
	if b, err := os.ReadFile(filepath.Join(v.dir, "console.log")); err == nil && len(b) > 0 {
		s.WriteString("\nguest console:\n" + lastLines(string(b), 20))
	}
	select {
	case <-v.exited:
		if e := strings.TrimSpace(v.stderr.String()); e != "" {
			s.WriteString("\nqemu: " + lastLines(e, 10))
		}
	default:
	}
	return s.String()
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// socketpair returns a connected pair: our end as a net.Conn (Close
// unblocks its readers), the child's as a file to inherit.
func socketpair() (net.Conn, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("creating socketpair: %w", err)
	}
	host := os.NewFile(uintptr(fds[0]), "host")
	conn, err := net.FileConn(host)
	host.Close()
	if err != nil {
		unix.Close(fds[1])
		return nil, nil, fmt.Errorf("creating socketpair: %w", err)
	}
	return conn, os.NewFile(uintptr(fds[1]), "child"), nil
}

// template is a saved VM that clones are restored from. Its directory in
// StateDir holds the guest RAM (mem), the device state (state) and the
// agent's hello frame (hello); it is written once and never modified, as
// clones map mem privately.
type template struct {
	key   string
	dir   string
	cfg   vmConfig
	hello []byte // the raw frame, length prefix included
	fresh bool   // made by this process

	ready chan struct{}
	err   error
}

func (t *template) memPath() string   { return filepath.Join(t.dir, "mem") }
func (t *template) statePath() string { return filepath.Join(t.dir, "state") }

// templateKey names a template: everything that shapes the VM and the
// saved state, the QEMU binary included.
func (b *Backend) templateKey(cfg vmConfig) string {
	var qemuID string
	if fi, err := os.Stat(cfg.QEMU); err == nil {
		qemuID = fmt.Sprintf("%d-%d", fi.Size(), fi.ModTime().UnixNano())
	}
	c := cfg
	c.Console = ""
	b2, _ := json.Marshal(struct {
		Version int
		Image   string
		QEMU    string
		Cfg     vmConfig
	}{2, b.opts.Image.Key, qemuID, c})
	return hashKey(b2)
}

func hashKey(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])[:16]
}

// template returns the ready template for cfg, making it if needed. Only
// one caller makes a given template; the others wait (or give up with
// their ctx, which does not stop the making).
func (b *Backend) template(ctx context.Context, cfg vmConfig, l sandbox.Limits) (*template, error) {
	key := b.templateKey(cfg)
	b.mu.Lock()
	t, ok := b.templates[key]
	if !ok {
		t = &template{key: key, dir: filepath.Join(b.opts.StateDir, "tpl-"+key), cfg: cfg, ready: make(chan struct{})}
		b.templates[key] = t
		go b.makeTemplate(t, l)
	}
	b.mu.Unlock()
	select {
	case <-t.ready:
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for template: %w", ctx.Err())
	}
	if t.err != nil {
		b.mu.Lock()
		if b.templates[key] == t {
			delete(b.templates, key) // let a later Create try again
		}
		b.mu.Unlock()
		return nil, t.err
	}
	return t, nil
}

func (b *Backend) dropTemplate(t *template) {
	b.mu.Lock()
	if b.templates[t.key] == t {
		delete(b.templates, t.key)
	}
	b.mu.Unlock()
	os.RemoveAll(t.dir)
}

// makeTemplate loads a saved template or boots and saves a new one.
func (b *Backend) makeTemplate(t *template, l sandbox.Limits) {
	defer close(t.ready)
	if hello, err := os.ReadFile(filepath.Join(t.dir, "hello")); err == nil {
		t.hello = hello
		b.log.Info("using saved template", "template", t.key)
		return
	}
	start := time.Now()
	b.log.Info("booting template vm (once per image and shape)", "template", t.key)
	ctx, cancel := context.WithTimeout(context.Background(), b.opts.BootTimeout)
	defer cancel()
	if err := b.saveTemplate(ctx, t, l); err != nil {
		t.err = fmt.Errorf("making template: %w", err)
		return
	}
	t.fresh = true
	b.log.Info("template saved", "template", t.key, "took", time.Since(start).Round(time.Millisecond))
}

// saveTemplate boots the template VM with its RAM in a shared file, waits
// for the agent's hello, pauses it and writes its device state (the RAM is
// skipped: x-ignore-shared), then renames the directory into place.
func (b *Backend) saveTemplate(ctx context.Context, t *template, l sandbox.Limits) error {
	tmp := t.dir + ".tmp-" + randomID()
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return err
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	state, err := os.OpenFile(filepath.Join(tmp, "state"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	defer state.Close()
	cfg := t.cfg
	cfg.MemFile = filepath.Join(tmp, "mem")
	cfg.MemShared = true
	v, err := b.start(ctx, "template-"+t.key, cfg, l, nil)
	if err != nil {
		return fmt.Errorf("booting vm: %w", err)
	}
	defer v.destroy()
	var hello []byte
	steps := []step{
		{"wait for agent", func(ctx context.Context) error {
			stop := context.AfterFunc(ctx, func() { v.agent.Close() })
			defer stop()
			var raw json.RawMessage
			if err := agentproto.ReadFrame(v.agent, &raw); err != nil {
				return errors.Join(err, ctx.Err())
			}
			var h agentproto.Hello
			if err := json.Unmarshal(raw, &h); err != nil {
				return err
			}
			if h.Error != "" {
				return fmt.Errorf("agent: %s", h.Error)
			}
			hello = binary.BigEndian.AppendUint32(nil, uint32(len(raw)))
			hello = append(hello, raw...)
			b.log.Info("template agent ready", "python", h.Python, "preloaded", h.Preloaded)
			return nil
		}},
		{"set migration capabilities", func(ctx context.Context) error {
			return v.qmp.setMigrationCaps(ctx, "x-ignore-shared")
		}},
		{"pause", v.qmp.stop},
		{"save state", func(ctx context.Context) error {
			if err := v.qmp.getfd(ctx, "state", state); err != nil {
				return err
			}
			if err := v.qmp.migrate(ctx, "fd:state"); err != nil {
				return err
			}
			for {
				mi, err := v.qmp.queryMigrate(ctx)
				if err != nil {
					return err
				}
				switch mi.Status {
				case "completed":
					return nil
				case "failed", "cancelled":
					return fmt.Errorf("migration %s: %s", mi.Status, mi.ErrorDesc)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}},
		{"quit", func(ctx context.Context) error {
			v.qmp.quit(ctx) // QEMU may close the socket before answering
			select {
			case <-v.exited:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}},
	}
	if err := runSteps(ctx, v.log, steps); err != nil {
		return fmt.Errorf("%w%s", err, v.consoleTail())
	}
	if err := errors.Join(state.Sync(), os.WriteFile(filepath.Join(tmp, "hello"), hello, 0o600)); err != nil {
		return err
	}
	os.Rename(filepath.Join(v.dir, "console.log"), filepath.Join(tmp, "console.log"))
	if err := os.Rename(tmp, t.dir); err != nil {
		// Another process may have stored the same template first: use
		// its files, which belong together.
		theirs, err2 := os.ReadFile(filepath.Join(t.dir, "hello"))
		if err2 != nil {
			return fmt.Errorf("storing template: %w", err)
		}
		t.hello = theirs
		return nil
	}
	ok = true
	t.hello = hello
	b.pruneTemplates(t.dir)
	return nil
}

// keepTemplates bounds the saved templates in StateDir (each holds the
// touched part of a guest's RAM): the newest are kept.
const keepTemplates = 8

func (b *Backend) pruneTemplates(keep string) {
	dirs, _ := filepath.Glob(filepath.Join(b.opts.StateDir, "tpl-*"))
	type tpl struct {
		dir string
		t   int64
	}
	var ts []tpl
	for _, d := range dirs {
		if fi, err := os.Stat(filepath.Join(d, "hello")); err == nil && d != keep {
			ts = append(ts, tpl{d, fi.ModTime().UnixNano()})
		}
	}
	slices.SortFunc(ts, func(a, b tpl) int { return int(b.t - a.t) })
	b.mu.Lock()
	inUse := map[string]bool{}
	for _, t := range b.templates {
		inUse[t.dir] = true
	}
	b.mu.Unlock()
	for i, t := range ts {
		if i >= keepTemplates-1 && !inUse[t.dir] {
			os.RemoveAll(t.dir)
		}
	}
}

func randomID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// qemuPIDs lists the QEMU processes of live VMs (for benchmarks of their
// memory).
func (b *Backend) qemuPIDs() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	var pids []int
	for v := range b.live {
		if v.cmd != nil && v.cmd.Process != nil {
			pids = append(pids, v.cmd.Process.Pid)
		}
	}
	return pids
}

// removeOrphans deletes what servers that died without Close left: run
// directories of processes that are gone and empty VM cgroups. (Their QEMU
// processes died with them: Pdeathsig.)
func removeOrphans(cgroupName string) {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "kiln-microvm-*"))
	for _, d := range dirs {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "kiln-microvm-"))
		if err != nil || pid == os.Getpid() {
			continue
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, os.ErrNotExist) {
			os.RemoveAll(d)
		}
	}
	cgs, _ := filepath.Glob(filepath.Join(cgroupRoot, "*", cgroupName, "*", "cgroup.procs"))
	v2, _ := filepath.Glob(filepath.Join(cgroupRoot, cgroupName, "*", "cgroup.procs"))
	for _, procs := range append(cgs, v2...) {
		if b, err := os.ReadFile(procs); err == nil && len(strings.TrimSpace(string(b))) == 0 {
			os.Remove(filepath.Dir(procs)) // fails harmlessly if in use
		}
	}
}

// vmmDirs fills a VMM's defaults, named after it: templates under the
// user's cache dir, per-VM files under a per-process temp dir, a cgroup
// name; and creates the directories.
func vmmDirs(vmm string, stateDir, runDir, cgroup *string) error {
	if *stateDir == "" {
		d, err := os.UserCacheDir()
		if err != nil {
			return fmt.Errorf("finding cache dir: %w", err)
		}
		*stateDir = filepath.Join(d, "kiln", vmm)
	}
	if *runDir == "" {
		*runDir = filepath.Join(os.TempDir(), fmt.Sprintf("kiln-%s-%d", vmm, os.Getpid()))
	}
	if *cgroup == "" {
		*cgroup = "kiln-" + vmm
	}
	for _, d := range []string{*stateDir, *runDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("creating %s: %w", d, err)
		}
	}
	return nil
}
