package jail

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// The zygote (Options.Zygote): instead of starting python in every box, a
// template box runs one python3 that has imported the preloaded modules
// (kiln-agent -zygote, internal/kernel/zygote.py), and each new box is
// forked from it. The fork gets its own user, mount, pid, network, ipc,
// uts and cgroup namespaces, cgroup, workspace, /tmp, /proc, rlimits,
// Landlock domain and seccomp filter before it runs anything of the
// model's, following a plan computed here from the jail's policy tables
// (zygote_plan_linux.go). The library pages stay shared copy-on-write.
//
// The template is itself jailed (its own mount, pid, network, ipc and uts
// namespaces, the read-only runtime root, no host environment) but stays
// in the host's user namespace, as the unprivileged host uid uidBase with
// only templateCaps: CAP_SETUID and CAP_SETGID, to let each fork become its
// box's own host uid before the fork creates the box's user namespace, and
// CAP_SETFCAP to write that namespace's id maps. So every box's user
// namespace is a direct child of the host's, owned by the box's own host
// uid, and the kernel charges the box's per-user counts (inotify
// instances, user namespaces, message queues, queued signals) to it, not
// to root. The template holds no capability over files, mounts, the
// network or other processes; it never runs model code, and boxes cannot
// reach it: it lives in their parent pid namespace, they only have copies
// of its mount namespace, and its control socket is closed in the fork
// before anything else.

// zygotes holds the backend's templates, one per preload list.
type zygotes struct {
	b    *Backend
	prog []byte // the seccomp program, assembled once
	tpls *boxkit.TemplateCache[*template]
}

func newZygotes(b *Backend) (*zygotes, error) {
	switch {
	case b.rootless:
		return nil, fmt.Errorf("the zygote needs root (a user namespace per box): %w", sandbox.ErrUnsupported)
	case b.cgroups == nil:
		return nil, fmt.Errorf("the zygote needs cgroups: %w", b.cgErr)
	}
	prog, err := seccompProgram()
	if err != nil {
		return nil, err
	}
	z := &zygotes{b: b, prog: prog}
	z.tpls = boxkit.NewTemplateCache(boxkit.TemplateOptions[*template]{
		Name:     "jail zygote",
		Stop:     (*template).stop,
		Dead:     (*template).dead,
		Rotation: zygoteRotation(b.opts),
		Logger:   b.log,
	})
	return z, nil
}

// template is one running zygote.
type template struct {
	key    string
	cmd    *exec.Cmd
	ctl    *net.UnixConn // SOCK_SEQPACKET: one message per box, with its fds
	wmu    sync.Mutex
	done   chan struct{} // closed when the template has exited
	stderr *tailBuffer
	// made are the notes of its boxes made in one step and in two
	// (madeNote), once its hello named the threads it keeps (awaitReady).
	made [2]*string
}

// makeNotes writes the template's made notes; threads are the names of
// the threads it keeps besides its main one.
func (t *template) makeNotes(threads []string) {
	preloads := t.key
	if preloads == "" {
		preloads = "none"
	}
	why := "this host or python cannot clone a box in one step (no clone(2) number for it, or a python without the fork steps)"
	if len(threads) > 0 {
		why = fmt.Sprintf("the template keeps threads its preloads started (%s)", strings.Join(threads, ", "))
	}
	t.made[0] = madeNote("forked from a template python that imported its preloads (%s) (the zygote), one-step: cloned straight into the box's namespaces as its PID 1, which forks the kernel and becomes the agent", preloads)
	t.made[1] = madeNote("forked from a template python that imported its preloads (%s) (the zygote), two-step: one more copy of the template per box, since %s", preloads, why)
}

// dead says why the template is gone, if it is.
func (t *template) dead() error {
	select {
	case <-t.done:
		return fmt.Errorf("jail zygote exited: %s", strings.TrimSpace(t.stderr.String()))
	default:
		return nil
	}
}

// stop kills the template and waits for its reaper, which closes its
// socket and removes its root.
func (t *template) stop() {
	t.cmd.Process.Kill()
	<-t.done
}

// get returns a ready template for preload and counts the box it will
// make; the caller must release it once that box is destroyed or was
// never made. An urgent caller does not wait for a template being built:
// it gets errWarming.
func (z *zygotes) get(ctx context.Context, preload []string, urgent bool) (*boxkit.Template[*template], error) {
	key := strings.Join(preload, ",")
	build := func(ctx context.Context, _ bool) (*template, time.Time, error) {
		t, err := z.start(ctx, key)
		return t, time.Time{}, err
	}
	if urgent {
		if t := z.tpls.Ready(key, build); t != nil {
			return t, nil
		}
		return nil, errWarming
	}
	return z.tpls.Get(ctx, key, build)
}

// start launches a template and waits until its python has imported the
// preloads (only the first call of a key and crash recovery wait for it;
// rotation starts replacements in the background).
func (z *zygotes) start(ctx context.Context, key string) (*template, error) {
	t, err := z.spawn(key)
	if err != nil {
		return nil, fmt.Errorf("starting jail zygote: %w", err)
	}
	ready := make(chan error, 1)
	go func() { ready <- t.awaitReady(z.b.log) }()
	select {
	case err = <-ready:
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		t.stop()
		return nil, fmt.Errorf("starting jail zygote: %w: %s", err, strings.TrimSpace(t.stderr.String()))
	}
	return t, nil
}

// spawn starts a template's process, with its root and control socket;
// its reaper removes both when it exits.
func (z *zygotes) spawn(key string) (_ *template, err error) {
	b := z.b
	var cl boxkit.Cleanup
	defer func() {
		if err != nil {
			cl.Run()
		}
	}()
	root, err := os.MkdirTemp(b.opts.StateDir, zygotePrefix())
	if err != nil {
		return nil, err
	}
	cl.Add(func() error { return os.Remove(root) })
	if err := os.Chmod(root, 0o711); err != nil {
		return nil, err
	}
	ctl, ctlBox, err := zygoteControl()
	if err != nil {
		return nil, err
	}
	defer ctlBox.Close()
	cl.Add(ctl.Close)
	cfgR, cfgW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer cfgR.Close()
	defer cfgW.Close()
	self, err := os.Open(b.opts.Self)
	if err != nil {
		return nil, err
	}
	defer self.Close()

	t := &template{key: key, ctl: ctl, done: make(chan struct{}), stderr: &tailBuffer{max: 4096}}
	cmd := exec.Command("/proc/self/fd/4", ZygoteInitArg)
	cmd.Env = []string{}
	cmd.Stdout, cmd.Stderr = t.stderr, t.stderr
	cmd.ExtraFiles = []*os.File{cfgR, self, ctlBox}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// Not a user namespace: forks create theirs as direct children
		// of the host's (becomeTemplateUser drops the rest of root).
		Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID |
			syscall.CLONE_NEWNET | syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS,
		Pdeathsig: syscall.SIGKILL,
	}
	t.cmd = cmd
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	cfg := z.templateConfig(root, key)
	json.NewEncoder(cfgW).Encode(&cfg)
	cfgW.Close()
	go func() {
		cmd.Wait()
		t.ctl.Close()
		os.Remove(root)
		close(t.done)
	}()
	return t, nil
}

// zygoteControl returns the two ends of a template's control socket: the
// host's, and the template's to inherit.
func zygoteControl() (*net.UnixConn, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	host := os.NewFile(uintptr(fds[0]), "zygote-ctl")
	box := os.NewFile(uintptr(fds[1]), "zygote-ctl-box")
	fc, err := net.FileConn(host)
	host.Close()
	if err != nil {
		box.Close()
		return nil, nil, err
	}
	return fc.(*net.UnixConn), box, nil
}

// templateConfig is the template's own jail.
func (z *zygotes) templateConfig(root, key string) initConfig {
	b := z.b
	args := b.agentArgs(sandbox.Spec{Preload: splitPreload(key)})
	// The template's /etc is every fork's: it holds the gateway's
	// resolv.conf and CA bundle where the boxes have a network.
	env, resolvConf, trust := b.netEnv()
	return initConfig{
		Root:        root,
		Agent:       b.opts.Agent,
		AgentArgs:   append(args, "-zygote"),
		Plan:        templatePlan(env),
		Template:    b.opts.Template,
		ResolvConf:  resolvConf,
		TrustBundle: trust,
	}
}

// awaitReady waits for the template's first message, which says its
// python has imported the preloads.
func (t *template) awaitReady(log *slog.Logger) error {
	buf := make([]byte, 4096)
	t.ctl.SetReadDeadline(time.Now().Add(2 * time.Minute))
	n, err := t.ctl.Read(buf)
	t.ctl.SetReadDeadline(time.Time{})
	if err != nil {
		return err
	}
	var hello struct {
		Ready     bool     `json:"ready"`
		Preloaded []string `json:"preloaded"`
		// Threads are the names of the template's threads besides its
		// main one once it stopped the pools it knows of (zygote.py,
		// _quiesce).
		Threads []string `json:"threads"`
	}
	if err := json.Unmarshal(buf[:n], &hello); err != nil {
		return err
	}
	if !hello.Ready {
		return errors.New("the zygote did not say it is ready")
	}
	t.makeNotes(hello.Threads)
	log.Debug("jail zygote ready", "preload", t.key, "preloaded", hello.Preloaded, "threads", 1+len(hello.Threads))
	if len(hello.Threads) > 0 {
		// A raw clone(2) would leave those threads' locks held in every
		// box; the template forks each box in two steps instead.
		log.Info("jail zygote keeps threads its preloads started; its boxes are forked in two steps, one more copy of the template each: preload fewer modules, or cap that library's thread pool at one thread",
			"preload", t.key, "threads", 1+len(hello.Threads), "names", hello.Threads)
	}
	return nil
}

func splitPreload(key string) []string {
	if key == "" {
		return nil
	}
	return strings.Split(key, ",")
}

// send asks the template for a box.
func (t *template) send(plan []byte, fds ...int) error {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	_, _, err := t.ctl.WriteMsgUnix(plan, unix.UnixRights(fds...), nil)
	if err != nil {
		return fmt.Errorf("asking the zygote for a box: %w", err)
	}
	return nil
}

// Close stops the backend's zygotes, and with them every box forked from
// them (each template is the init of the pid namespace its boxes nest in).
func (b *Backend) Close() error {
	if b.zy != nil {
		b.zy.tpls.Close()
	}
	if b.cgroups != nil {
		b.cgroups.closeServer()
	}
	return nil
}

// forkBox makes a box from the zygote. It returns (nil, nil) when the
// zygote is off or not working, and Create then starts the box directly;
// also for an urgent box while the template warms, whose preloads it then
// drops (early_linux.go).
func (b *Backend) forkBox(ctx context.Context, spec *sandbox.Spec) (sandbox.Sandbox, error) {
	if b.zy == nil {
		return nil, nil
	}
	t, err := b.zy.get(ctx, spec.Preload, spec.Urgent && b.earlyBoxes())
	if errors.Is(err, errWarming) {
		b.early(spec)
		return nil, nil
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		b.log.Warn("jail zygote unavailable; starting the box directly", "err", err)
		b.made.Store(madeNote("started as a python of its own, as a new process: the zygote is unavailable: %v", err))
		return nil, nil
	}
	box, err := b.fork(ctx, t, *spec)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		b.log.Warn("forking a box from the zygote; starting it directly", "err", err)
		b.made.Store(madeNote("started as a python of its own, as a new process: forking it from the zygote failed: %v", err))
		return nil, nil
	}
	return box, nil
}

func (b *Backend) fork(ctx context.Context, tt *boxkit.Template[*template], spec sandbox.Spec) (_ sandbox.Sandbox, err error) {
	t := tt.Value
	lim := spec.Limits.WithDefaults()
	start := time.Now()
	var cl boxkit.Cleanup
	defer func() {
		if err != nil {
			cl.Run()
		}
	}()
	cl.Add(func() error { b.zy.tpls.Release(tt); return nil }) // last, after the box is gone
	cg, err := b.forkCgroup(spec.ID, lim)
	if err != nil {
		return nil, err
	}
	if cg != nil {
		cl.Add(cg.Destroy)
	}

	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("creating agent socket: %w", err)
	}
	// The box announces itself with one byte; the kernel attaches the
	// sender's pid, translated into ours.
	if err := unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return nil, fmt.Errorf("setting SO_PASSCRED: %w", err)
	}
	hostFile := os.NewFile(uintptr(fds[0]), "agent-host")
	fc, err := net.FileConn(hostFile)
	hostFile.Close()
	if err != nil {
		unix.Close(fds[1])
		return nil, fmt.Errorf("wrapping agent socket: %w", err)
	}
	host := fc.(*net.UnixConn)
	cl.Add(host.Close)
	stderr := &tailBuffer{max: 4096}
	errR, errW, err := os.Pipe()
	if err != nil {
		unix.Close(fds[1])
		return nil, err
	}
	go func() { copyTail(stderr, errR) }()

	plan, err := json.Marshal(b.zy.plan(spec, lim, b.nextSlot()))
	if err == nil {
		err = t.send(plan, fds[1], int(errW.Fd()))
	}
	unix.Close(fds[1])
	errW.Close()
	if err != nil {
		return nil, err
	}

	stop := context.AfterFunc(ctx, func() { host.SetReadDeadline(time.Now()) })
	defer stop()
	fail := func(step string, err error) error {
		time.Sleep(10 * time.Millisecond) // let the box's last words arrive
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return fmt.Errorf("forking jail: %s: %w", step, err)
	}
	sent := time.Now()
	// G, the fork, says 'c' first thing; it waits in the template's
	// namespaces until it is in the box's cgroup. Then it becomes the
	// box's host uid, creates the box's namespaces and forks P, the box's
	// PID 1, which says 'p'. Where the template can, it clones P straight
	// into the box's user and pid namespaces instead, and P says both.
	gpid, err := readHello(host, 'c')
	if err != nil {
		return nil, fail("waiting for the fork", err)
	}
	forked := time.Now()
	if err := watchKill(&cl, gpid); err != nil {
		return nil, fmt.Errorf("watching the fork: %w", err)
	}
	if cg != nil {
		if err := cg.Add(gpid); err != nil {
			return nil, err
		}
	}
	if _, err := host.Write([]byte{'k'}); err != nil {
		return nil, fail("releasing the fork", err)
	}
	pid, err := readHello(host, 'p')
	if err != nil {
		return nil, fail("waiting for the box's init", err)
	}
	// The box's PID 1: its death ends the pid namespace.
	if err := watchKill(&cl, pid); err != nil {
		return nil, fmt.Errorf("watching the box's init: %w", err)
	}
	// P has its network namespace by now ('p' follows the unshare); no
	// code of the model's runs before the agent answers, after this.
	att, err := b.attach(ctx, pid, spec.ID, &cl)
	if err != nil {
		return nil, fail("attaching the box to the egress gateway", err)
	}
	if rc, err := host.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) { unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PASSCRED, 0) })
	}
	host.SetReadDeadline(time.Time{})
	stop()

	conn, err := sandbox.NewAgentConn(ctx, spec.ID, host, cl.Run)
	if err != nil {
		return nil, fail("starting the agent", err) // NewAgentConn destroyed the box
	}
	// One step: the template cloned the box's PID 1 straight into its
	// namespaces (zygote.py, _clone_box), so 'c' and 'p' came from it.
	path := "two-step"
	if gpid == pid {
		path = "one-step"
	}
	b.log.Debug("forked a box", "id", spec.ID, "one_step", gpid == pid, "path", path, "cgroup", sent.Sub(start), "fork", forked.Sub(sent), "ready", time.Since(forked))
	if gpid == pid {
		b.made.Store(t.made[0])
	} else {
		b.made.Store(t.made[1])
	}
	return &jailBox{AgentConn: conn, cg: cg, egress: att}, nil
}

// watchKill pushes onto cl a step that kills process pid and waits, a
// while, for it to end.
func watchKill(cl *boxkit.Cleanup, pid int) error {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return err
	}
	cl.Add(func() error {
		defer unix.Close(pidfd)
		unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		for range 50 {
			if n, err := unix.Poll(fds, 100); n > 0 || (err != nil && !errors.Is(err, unix.EINTR)) {
				break
			}
		}
		return nil
	})
	return nil
}

// nextSlot picks the box's uid range (from 1 on: the first uid of slot 0
// is the zygote template's, so boxes never get it).
func (b *Backend) nextSlot() int {
	slot, _ := b.slots.Next()
	return slot
}

// readHello reads the one byte want and returns its sender's pid.
func readHello(c *net.UnixConn, want byte) (int, error) {
	buf := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(unix.SizeofUcred))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return 0, err
	}
	if n != 1 || buf[0] != want {
		return 0, fmt.Errorf("the box said %q, want %q", buf[:n], want)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) == 0 {
		return 0, fmt.Errorf("no credentials with the box's hello: %v", err)
	}
	cred, err := unix.ParseUnixCredentials(&msgs[0])
	if err != nil {
		return 0, err
	}
	if cred.Pid <= 0 {
		return 0, errors.New("the box's pid is not visible here")
	}
	return int(cred.Pid), nil
}

func copyTail(dst *tailBuffer, src *os.File) {
	defer src.Close()
	buf := make([]byte, 1024)
	for {
		n, err := src.Read(buf)
		dst.Write(buf[:n])
		if err != nil {
			return
		}
	}
}

// zygoteOff is the made note of a backend whose zygote is off.
func zygoteOff(why error) *string {
	return madeNote("each starts a python of its own, as a new process (the zygote is off: %v)", why)
}

// initZygotes turns the zygote on when Options.Zygote asks for it.
// (removeOrphanedState removes the mount points of dead servers'
// templates.)
func (b *Backend) initZygotes() {
	if !b.opts.Zygote {
		b.zyOff = zygoteOff(errors.New("not asked for"))
		return
	}
	z, err := newZygotes(b)
	if err != nil {
		b.log.Warn("jail zygote off; every box starts its own python", "err", err)
		b.zyOff = zygoteOff(err)
		return
	}
	b.zy = z
}
