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
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/agentproto"
	"kiln/internal/boxpolicy"
	"kiln/internal/egress"
	"kiln/internal/guestinit"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// Backend creates microVM boxes. It is safe for concurrent use.
type Backend struct {
	opts  Options
	log   *slog.Logger
	notes []string

	tpls *boxkit.TemplateCache[*template]

	mu     sync.Mutex
	live   map[*vm]struct{}
	closed bool
	tscKHz int64  // TCG only: the guest's TSC rate, see kernelCmdline
	tplfs  string // the template's ext4 image (template_linux.go); "": none

	self    string              // kiln's executable, re-executed as QEMU's jail init
	vmmUIDs *boxpolicy.UIDSlots // each jailed QEMU's host uid (newVMMUIDs)
	net     *guestNet           // every VM's network; nil: none (net_linux.go)
}

// New checks opts and returns the backend. It does not boot anything:
// templates are made on first use (or by Warm).
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
	switch {
	case opts.TemplateMaxClones == 0:
		opts.TemplateMaxClones = DefaultTemplateMaxClones
	case opts.TemplateMaxClones < 0:
		opts.TemplateMaxClones = 0
	}
	switch {
	case opts.TemplateMaxAge == 0:
		opts.TemplateMaxAge = DefaultTemplateMaxAge
	case opts.TemplateMaxAge < 0:
		opts.TemplateMaxAge = 0
	}
	if err := vmmDirs("microvm", &opts.StateDir, &opts.RunDir, &opts.Cgroup); err != nil {
		return nil, err
	}
	removeOrphans(opts.Cgroup)
	var tplfs string
	if opts.Template != "" {
		if tplfs, err = templateImage(context.Background(), opts.StateDir, opts.Template); err != nil {
			return nil, err
		}
	}
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding own executable: %w", err)
	}
	b := &Backend{
		self:  self,
		opts:  opts,
		tplfs: tplfs,
		net:   newGuestNet(opts.Egress, opts.Policy),
		log:   opts.Logger.With("backend", "microvm", "accel", opts.Accel),
		live:  map[*vm]struct{}{},
	}
	b.tpls = boxkit.NewTemplateCache(boxkit.TemplateOptions[*template]{
		Name:             "template",
		Stop:             (*template).close,
		KeepInUseOnClose: true, // a restore under way reads its memfd
		Rotation:         boxkit.Rotation{MaxUses: opts.TemplateMaxClones, MaxAge: opts.TemplateMaxAge},
		Logger:           b.log,
	})
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
	b.vmmUIDs = newVMMUIDs()
	return b, nil
}

// Check implements sandbox.Checker: the image's files exist, QEMU runs,
// under KVM /dev/kvm opens, and a VM starts and runs a command.
func (b *Backend) Check(ctx context.Context) error {
	if err := b.checkHost(ctx); err != nil {
		return err
	}
	box, err := b.Create(ctx, sandbox.Spec{ID: "doctor"})
	if err != nil {
		return fmt.Errorf("starting a VM: %w", err)
	}
	defer box.Close()
	return sandbox.Probe(ctx, box)
}

// checkHost checks what a VM needs from the host, without starting one.
func (b *Backend) checkHost(ctx context.Context) error {
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
	return checkTun(b.net)
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
	if err := checkCmdline(cfg.Cmdline); err != nil {
		return nil, err
	}
	if b.opts.ColdBoot {
		return b.coldBoot(ctx, id, cfg, limits)
	}
	tpl, err := b.template(ctx, cfg, limits)
	if err != nil {
		return nil, err
	}
	sb, err := b.restore(ctx, id, tpl, limits)
	if err != nil && ctx.Err() == nil && !tpl.Value.fresh {
		// A template saved by an earlier run may not load (a QEMU
		// upgrade that kept its mtime, a damaged file): make it again.
		b.log.Warn("restoring saved template failed; making it again", "err", err)
		b.tpls.Drop(tpl)
		os.RemoveAll(tpl.Value.dir)
		if tpl, err = b.template(ctx, cfg, limits); err != nil {
			return nil, err
		}
		sb, err = b.restore(ctx, id, tpl, limits)
	}
	return sb, err
}

// Warm implements sandbox.Warmer: it makes (or loads) the template for
// spec's shape now, so that the first Create does not wait for a boot.
// Servers call it at start.
func (b *Backend) Warm(ctx context.Context, spec sandbox.Spec) error {
	limits := spec.Limits.WithDefaults()
	cfg := b.vmConfig(limits, cleanPreload(spec.Preload))
	if err := checkCmdline(cfg.Cmdline); err != nil {
		return err
	}
	key := b.templateKey(cfg)
	return b.tpls.Warm(ctx, key, b.buildTemplate(key, cfg, limits))
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
	// A template being made fails now that the backend is closed; one in
	// use is closed when its last restore is done.
	b.tpls.Close()
	if !b.opts.Verbose {
		errs = append(errs, os.RemoveAll(b.opts.RunDir))
	}
	return errors.Join(errs...)
}

func (b *Backend) vmConfig(l sandbox.Limits, preload []string) vmConfig {
	mem, cpus := guestShape(l)
	im := b.opts.Image
	var extra []string
	if b.tplfs != "" {
		extra = append(extra, guestinit.TemplateParam+"="+templateDisk)
	}
	return vmConfig{
		QEMU:      b.opts.QEMU,
		Accel:     b.opts.Accel,
		MemoryMiB: mem,
		CPUs:      cpus,
		Kernel:    im.KernelPath(),
		Initrd:    im.InitrdPath(),
		Rootfs:    im.RootfsPath(),
		Template:  b.tplfs,
		Cmdline:   kernelCmdline(l, b.net, preload, b.opts.Verbose, b.tscKHz, "serial", extra...),
		Plan:      guestPlan(l, b.net).Digest(),
		Seccomp:   !b.opts.NoSeccomp,
		Net:       b.net != nil,
	}
}

// qemuLimits are the cgroup limits of one QEMU process: guest RAM plus the
// VMM's own overhead (TCG's translation cache is the larger part of it).
func (b *Backend) qemuLimits(cfg vmConfig, l sandbox.Limits) boxkit.CgroupLimits {
	overhead := int64(192 << 20)
	if cfg.Accel == AccelTCG {
		overhead += 256 << 20
	}
	return boxkit.CgroupLimits{MemoryBytes: cfg.MemoryMiB<<20 + overhead, Pids: 128, CPUs: l.CPUs}
}

// attach is box id's attachment to the gateway, in a namespace of its
// own; nil without a network.
func (b *Backend) attach(ctx context.Context, id string) (*vmLink, error) {
	if b.net == nil {
		return nil, nil
	}
	return attachVM(ctx, b.opts.Egress, b.net, b.opts.Policy, 0, id)
}

// coldBoot boots a fresh VM and waits for its agent.
func (b *Backend) coldBoot(ctx context.Context, id string, cfg vmConfig, l sandbox.Limits) (sandbox.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, b.opts.BootTimeout)
	defer cancel()
	link, err := b.attach(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("booting vm: %w", err)
	}
	v, err := b.start(ctx, id, cfg, l, nil, nil, link)
	if err != nil {
		return nil, fmt.Errorf("booting vm: %w", err)
	}
	sb, err := sandbox.NewAgentConn(ctx, id, v.agent, v.destroy)
	if err != nil {
		return nil, fmt.Errorf("booting vm: %w%s", err, v.consoleTail())
	}
	if err := checkPlan(sb.Hello(), cfg.Plan); err != nil {
		sb.Close()
		return nil, fmt.Errorf("booting vm: %w", err)
	}
	if link != nil {
		// A booted guest has entropy and the time of its own; the seed
		// brings its address.
		if err := v.reseed(ctx); err != nil {
			sb.Close()
			return nil, fmt.Errorf("booting vm: configuring its network: %w%s", err, v.consoleTail())
		}
	}
	return withLink(sb, link), nil
}

// restore starts a clone of tpl and hands out its agent. The clone's agent
// said hello in the template already; the saved frame is replayed.
func (b *Backend) restore(ctx context.Context, id string, tt *boxkit.Template[*template], l sandbox.Limits) (sandbox.Sandbox, error) {
	defer b.tpls.Release(tt)
	tpl := tt.Value
	state, err := tpl.openState()
	if err != nil {
		return nil, fmt.Errorf("restoring vm: %w", err)
	}
	defer state.Close()
	cfg := tpl.cfg
	cfg.MemFile = memFDPath
	cfg.MemShared = false
	cfg.Incoming = true
	link, err := b.attach(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("restoring vm: %w", err)
	}
	v, err := b.start(ctx, id, cfg, l, state, tpl.mem, link)
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
	}
	if err := runSteps(ctx, v.log, steps); err != nil {
		v.destroy()
		return nil, fmt.Errorf("restoring vm: %w%s", err, v.consoleTail())
	}
	sb, err := sandbox.RestoreConn(ctx, id, v.agent, tpl.hello, v.destroy, &sandbox.RestoreOptions{ReseedGuest: v.reseed})
	if err != nil {
		return nil, fmt.Errorf("restoring vm: %w%s", err, v.consoleTail())
	}
	return withLink(sb, link), nil
}

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

	console string  // host path of the guest console log
	link    *vmLink // the box's attachment; nil without a network (and in a template)

	exited  chan struct{}
	stderr  *bytes.Buffer
	cleanup boxkit.Cleanup
}

// start spawns QEMU for cfg with its sockets, in its own cgroup and
// jailed (see jail_linux.go), and connects QMP. state is passed as the
// migration fd, mem as the guest RAM (cfg.MemFile is then memFDPath).
// With cfg.Net, link is the box's attachment, which the VM owns from now
// on (closed with it, after QEMU is gone); nil for a template, which gets
// a loose tap.
func (b *Backend) start(ctx context.Context, id string, cfg vmConfig, l sandbox.Limits, state, mem *os.File, link *vmLink) (_ *vm, err error) {
	v := &vm{id: id, dir: filepath.Join(b.opts.RunDir, id), log: b.log.With("vm", id), exited: make(chan struct{}), stderr: new(bytes.Buffer), link: link}
	v.defer_(link.close)
	defer func() {
		if err != nil {
			v.destroy()
		}
	}()
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, sandbox.ErrClosed
	}
	var tap *os.File
	if cfg.Net {
		if tap = link.tap(); tap == nil {
			t, closeTap, err := egress.LooseTap(0)
			if err != nil {
				return nil, fmt.Errorf("making the template's tap: %w", err)
			}
			v.defer_(closeTap)
			tap = t
		}
	}
	if !b.opts.Verbose { // verbose keeps console logs for debugging
		v.defer_(func() error { return os.RemoveAll(v.dir) })
	}
	if err := os.Mkdir(v.dir, 0o700); err != nil {
		return nil, err
	}
	v.console = filepath.Join(v.dir, "console.log")
	cfg.Console = v.console

	qmpHost, children, err := v.openSockets()
	if err != nil {
		return nil, err
	}
	defer boxkit.CloseFiles(children)
	cmd, opened, err := b.qemuCmd(v, cfg, append(children, state, mem, tap))
	if err != nil {
		return nil, err
	}
	defer boxkit.CloseFiles(opened)
	var cg *boxkit.CgroupGroup
	if !b.opts.NoCgroup {
		if cg, err = newCgroup(b.opts.Cgroup, id, b.qemuLimits(cfg, l)); err != nil {
			return nil, err
		}
		v.defer_(cg.Destroy)
	}
	v.log.Debug("starting qemu", "args", strings.Join(cmd.Args, " "))
	err = cmd.Start()
	// QEMU holds the child ends now; ours would hide its EOF.
	boxkit.CloseFiles(children)
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
		if err := cg.Add(cmd.Process.Pid); err != nil {
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

// openSockets opens the VM's agent, QMP and seed sockets and pushes the
// closing of their host ends. It returns the QMP host end and the child
// ends, for QEMU's fds 3, 4 and 5, which the caller closes.
func (v *vm) openSockets() (qmpHost net.Conn, children []*os.File, err error) {
	defer func() {
		if err != nil {
			boxkit.CloseFiles(children)
		}
	}()
	for _, host := range []*net.Conn{&v.agent, &qmpHost, &v.seed} {
		h, child, err := socketpair()
		if err != nil {
			return nil, children, err
		}
		*host = h
		v.defer_(closer(h))
		children = append(children, child)
	}
	return qmpHost, children, nil
}

// qemuCmd is the QEMU command for cfg with files as its fds from 3 on,
// its output going to v.stderr: jailed (jail_linux.go) unless
// NoNamespaces. The caller closes opened once QEMU has started.
func (b *Backend) qemuCmd(v *vm, cfg vmConfig, files []*os.File) (cmd *exec.Cmd, opened []*os.File, err error) {
	if b.opts.NoNamespaces {
		cmd = exec.Command(cfg.QEMU, cfg.args()...)
		cmd.ExtraFiles = files
		cmd.Env = []string{"PATH=/usr/bin:/bin"}
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	} else if cmd, opened, err = b.jailedQEMU(v, cfg, files); err != nil {
		return nil, nil, fmt.Errorf("jailing qemu: %w", err)
	}
	cmd.Stdout = v.stderr
	cmd.Stderr = v.stderr
	return cmd, opened, nil
}

func (v *vm) defer_(f func() error) { v.cleanup.Add(f) }

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
func (v *vm) destroy() error { return v.cleanup.Run() }

// reseed sends the guest fresh entropy, the time and its network, and
// waits for guestinit to have reseeded the kernel's RNG, set the clock
// and addressed eth0: without it every clone of a template would draw the
// same random numbers until the kernel reseeded by itself, under KVM its
// clock would stand at the template's save time, and a box with a
// network would have no address.
func (v *vm) reseed(ctx context.Context) error { return sendSeed(ctx, v.seed, v.link.seed()) }

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
	if b, err := os.ReadFile(v.console); err == nil && len(b) > 0 {
		s.WriteString("\nguest console:\n" + lastLines(string(b), 20))
	}
	select {
	case <-v.exited:
		if e := strings.TrimSpace(v.stderr.String()); e != "" {
			s.WriteString("\nqemu: " + headTail(e, 8, 4))
		}
	case <-time.After(time.Second): // still running, or its exit not seen yet
	}
	return s.String()
}

// headTail keeps the first head and last tail lines of s (a crash's
// message comes first, QEMU's last).
func headTail(s string, head, tail int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) <= head+tail {
		return strings.Join(lines, "\n")
	}
	return strings.Join(lines[:head], "\n") + "\n…\n" + strings.Join(lines[len(lines)-tail:], "\n")
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
// agent's hello frame (hello); it is written once and never modified. In
// memory it is open: the RAM as a sealed memfd that clones map privately,
// the state as a file each clone reopens, so the directory may go while
// the template still serves.
type template struct {
	key   string
	dir   string
	cfg   vmConfig
	hello agentproto.Hello
	fresh bool // made by this process
	mem   *os.File
	state *os.File
}

func (t *template) memPath() string   { return filepath.Join(t.dir, "mem") }
func (t *template) statePath() string { return filepath.Join(t.dir, "state") }

// openState opens the template's device state afresh (its own offset),
// through the descriptor the template holds.
func (t *template) openState() (*os.File, error) {
	return os.Open(fmt.Sprintf("/proc/self/fd/%d", t.state.Fd()))
}

// close releases the template's memfd and state once nothing uses them.
func (t *template) close() {
	if t.mem != nil {
		t.mem.Close()
	}
	if t.state != nil {
		t.state.Close()
	}
}

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

// template returns the ready template for cfg, making it if needed, and
// counts a clone against it; the caller releases it when its restore is
// done. Only one caller makes a given template; the others wait (or give
// up with their ctx, which does not stop the making).
func (b *Backend) template(ctx context.Context, cfg vmConfig, l sandbox.Limits) (*boxkit.Template[*template], error) {
	key := b.templateKey(cfg)
	return b.tpls.Get(ctx, key, b.buildTemplate(key, cfg, l))
}

// buildTemplate loads a saved template (unless it replaces one) or boots
// and saves a new one.
func (b *Backend) buildTemplate(key string, cfg vmConfig, l sandbox.Limits) boxkit.TemplateBuild[*template] {
	return func(ctx context.Context, replacing bool) (*template, time.Time, error) {
		t := &template{key: key, dir: filepath.Join(b.opts.StateDir, "tpl-"+key), cfg: cfg}
		if !replacing {
			born, err := b.loadTemplate(t)
			if err == nil {
				b.log.Info("using saved template", "template", t.key)
				return t, born, nil
			} else if !errors.Is(err, os.ErrNotExist) {
				b.log.Warn("saved template unusable; making it again", "template", t.key, "err", err)
			}
		}
		start := time.Now()
		b.log.Info("booting template vm (once per image and shape, and at every rotation)", "template", t.key)
		ctx, cancel := context.WithTimeout(ctx, b.opts.BootTimeout)
		defer cancel()
		if err := b.saveTemplate(ctx, t, l); err != nil {
			return nil, time.Time{}, fmt.Errorf("making template: %w", err)
		}
		t.fresh = true
		b.log.Info("template saved", "template", t.key, "took", time.Since(start).Round(time.Millisecond))
		return t, time.Time{}, nil
	}
}

// loadTemplate opens the template saved in t.dir, and says when it was
// saved: its age counts from then.
func (b *Backend) loadTemplate(t *template) (time.Time, error) {
	fi, err := os.Stat(filepath.Join(t.dir, "hello"))
	if err != nil {
		return time.Time{}, err
	}
	hello, err := loadHello(filepath.Join(t.dir, "hello"), t.cfg.Plan)
	if err != nil {
		return time.Time{}, err
	}
	state, err := os.Open(t.statePath())
	if err != nil {
		return time.Time{}, err
	}
	mem, err := loadMemfd(t.memPath())
	if err != nil {
		state.Close()
		return time.Time{}, err
	}
	t.hello, t.state, t.mem = hello, state, mem
	return fi.ModTime(), nil
}

// saveTemplate boots the template VM with its RAM in a shared memfd, waits
// for the agent's hello, pauses it and writes its device state (the RAM is
// skipped: x-ignore-shared), seals the RAM, writes it beside the state for
// later runs, then renames the directory into place (replacing an older
// template of the same key).
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
	state, err := os.OpenFile(filepath.Join(tmp, "state"), os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if !ok {
			state.Close()
		}
	}()
	cfg := t.cfg
	mem, err := newMemfd("kiln-template", cfg.MemoryMiB<<20)
	if err != nil {
		return err
	}
	defer func() {
		if !ok {
			mem.Close()
		}
	}()
	cfg.MemFile = memFDPath
	cfg.MemShared = true
	v, err := b.start(ctx, "template-"+t.key+"-"+randomID()[:4], cfg, l, nil, mem, nil)
	if err != nil {
		return fmt.Errorf("booting vm: %w", err)
	}
	defer v.destroy()
	var hello agentproto.Hello
	steps := []step{
		{"wait for agent", func(ctx context.Context) error {
			stop := context.AfterFunc(ctx, func() { v.agent.Close() })
			defer stop()
			var err error
			if hello, err = readHello(v.agent, cfg.Plan); err != nil {
				return errors.Join(err, ctx.Err())
			}
			b.log.Info("template agent ready", "python", hello.Python, "preloaded", hello.Preloaded)
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
	if err := sealMemfd(mem); err != nil {
		return err
	}
	memFile, err := os.OpenFile(filepath.Join(tmp, "mem"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	err = errors.Join(copySparse(memFile, mem), memFile.Sync(), memFile.Close(), state.Sync(),
		writeHello(filepath.Join(tmp, "hello"), hello))
	if err != nil {
		return fmt.Errorf("storing template: %w", err)
	}
	os.Rename(v.console, filepath.Join(tmp, "console.log"))
	// A template of this key saved before (by an earlier run, or the one
	// this replaces) goes; its users hold its files open.
	old := t.dir + ".old-" + randomID()
	if os.Rename(t.dir, old) == nil {
		defer os.RemoveAll(old)
	}
	if err := os.Rename(tmp, t.dir); err != nil {
		return fmt.Errorf("storing template: %w", err)
	}
	ok = true
	t.hello, t.mem, t.state = hello, mem, state
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
	inUse := map[string]bool{}
	for _, t := range b.tpls.Values() {
		inUse[t.dir] = true
	}
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
	boxkit.SweepOrphans(os.TempDir(), "kiln-microvm-", os.RemoveAll)
	removeOrphanCgroups(cgroupName)
}

// vmmDirs fills a VMM's defaults, named after it: templates under the
// user's cache dir, per-VM files under a per-process temp dir named by the
// process's owner stamp (kiln-<vmm>-<pid>.<start>), a cgroup name; and
// creates the directories.
func vmmDirs(vmm string, stateDir, runDir, cgroup *string) error {
	if *stateDir == "" {
		d, err := os.UserCacheDir()
		if err != nil {
			return fmt.Errorf("finding cache dir: %w", err)
		}
		*stateDir = filepath.Join(d, "kiln", vmm)
	}
	if *runDir == "" {
		*runDir = filepath.Join(os.TempDir(), "kiln-"+vmm+"-"+boxkit.Self().String())
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

// newVMMUIDs hands out the host uids of jailed QEMU processes, one per VM,
// from boxpolicy.VMMUIDs (no real user's, no /etc/subuid entry's, not the
// jail backend's), starting at random so that two servers on one host are
// unlikely to hand out the same uid at once.
func newVMMUIDs() *boxpolicy.UIDSlots {
	s := &boxpolicy.UIDSlots{Range: boxpolicy.VMMUIDs, Size: 1}
	var start [8]byte
	rand.Read(start[:])
	s.Start(binary.BigEndian.Uint64(start[:]))
	return s
}
