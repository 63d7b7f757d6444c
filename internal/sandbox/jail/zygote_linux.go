package jail

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox"
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
// The template is itself jailed (its own namespaces, the read-only runtime
// root, no host environment) but keeps the capabilities of root in its
// own user namespace, which maps kiln's whole box uid range: it needs them
// to give each fork its own user namespace and uid range. It never runs
// model code, and boxes cannot reach it: it lives in their parent pid
// namespace, they only have copies of its mount namespace, and its
// control socket is closed in the fork before anything else.

// zygotes holds the backend's templates, one per preload list.
type zygotes struct {
	b      *Backend
	mu     sync.Mutex
	byKey  map[string]*template
	closed bool
	prog   []byte // the seccomp program, assembled once
}

func newZygotes(b *Backend) (*zygotes, error) {
	switch {
	case b.opts.Egress != nil && !b.opts.Policy.Empty():
		return nil, fmt.Errorf("the zygote does not attach boxes to the egress gateway yet: %w", sandbox.ErrUnsupported)
	case b.rootless:
		return nil, fmt.Errorf("the zygote needs root (a user namespace per box): %w", sandbox.ErrUnsupported)
	case b.cgroups == nil:
		return nil, fmt.Errorf("the zygote needs cgroups: %w", b.cgErr)
	}
	prog, err := seccompProgram()
	if err != nil {
		return nil, err
	}
	return &zygotes{b: b, byKey: map[string]*template{}, prog: prog}, nil
}

// template is one running zygote.
type template struct {
	key    string
	cmd    *exec.Cmd
	ctl    *net.UnixConn // SOCK_SEQPACKET: one message per box, with its fds
	wmu    sync.Mutex
	ready  chan struct{} // closed once err or hello is set
	err    error
	done   chan struct{} // closed when the template has exited
	stderr *tailBuffer
}

func (t *template) alive() bool {
	select {
	case <-t.done:
		return false
	default:
		return true
	}
}

// get returns the running template for preload, starting one if needed.
func (z *zygotes) get(ctx context.Context, preload []string) (*template, error) {
	key := strings.Join(preload, ",")
	z.mu.Lock()
	if z.closed {
		z.mu.Unlock()
		return nil, sandbox.ErrClosed
	}
	t := z.byKey[key]
	if t == nil || !t.alive() {
		if t != nil {
			z.b.log.Warn("jail zygote exited; starting a new one", "preload", key, "stderr", t.stderr.String())
		}
		t = z.start(key)
		z.byKey[key] = t
	}
	z.mu.Unlock()
	select {
	case <-t.ready:
		return t, t.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// start launches a template; it becomes ready in the background.
func (z *zygotes) start(key string) *template {
	t := &template{key: key, ready: make(chan struct{}), done: make(chan struct{}), stderr: &tailBuffer{max: 4096}}
	fail := func(err error) *template {
		t.err = fmt.Errorf("starting jail zygote: %w", err)
		close(t.ready)
		close(t.done)
		return t
	}
	b := z.b
	root, err := os.MkdirTemp(b.opts.StateDir, zygotePrefix(os.Getpid()))
	if err != nil {
		return fail(err)
	}
	if err := os.Chmod(root, 0o711); err != nil {
		os.Remove(root)
		return fail(err)
	}
	ctlFDs, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		os.Remove(root)
		return fail(err)
	}
	ctlHost := os.NewFile(uintptr(ctlFDs[0]), "zygote-ctl")
	ctlBox := os.NewFile(uintptr(ctlFDs[1]), "zygote-ctl-box")
	defer ctlBox.Close()
	fc, err := net.FileConn(ctlHost)
	ctlHost.Close()
	if err != nil {
		os.Remove(root)
		return fail(err)
	}
	t.ctl = fc.(*net.UnixConn)
	cfgR, cfgW, err := os.Pipe()
	if err != nil {
		t.ctl.Close()
		os.Remove(root)
		return fail(err)
	}
	defer cfgR.Close()
	defer cfgW.Close()
	self, err := os.Open(b.opts.Self)
	if err != nil {
		t.ctl.Close()
		os.Remove(root)
		return fail(err)
	}
	defer self.Close()

	cmd := exec.Command("/proc/self/fd/4", ZygoteInitArg)
	cmd.Env = []string{}
	cmd.Stdout, cmd.Stderr = t.stderr, t.stderr
	cmd.ExtraFiles = []*os.File{cfgR, self, ctlBox}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS | syscall.CLONE_NEWPID |
			syscall.CLONE_NEWNET | syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS,
		Pdeathsig:  syscall.SIGKILL,
		Credential: &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true},
		// The whole box range: each fork maps its own slot of it.
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: uidBase, Size: uidSlots * uidRange}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: uidBase, Size: uidSlots * uidRange}},
		GidMappingsEnableSetgroups: false,
	}
	t.cmd = cmd
	if err := cmd.Start(); err != nil {
		t.ctl.Close()
		os.Remove(root)
		return fail(err)
	}
	args := b.agentArgs(sandbox.Spec{Preload: splitPreload(key)})
	cfg := initConfig{
		Root:      root,
		Agent:     b.opts.Agent,
		AgentArgs: append(args, "-zygote"),
		Env:       b.env(),
		Hostname:  "kiln",
		Workspace: 1 << 20,
		Tmp:       64 << 20, // matplotlib's font cache, built once
		Inodes:    4096,
		Pids:      sandbox.DefaultLimits.Pids,
		OpenFiles: sandbox.DefaultLimits.OpenFiles,
	}
	json.NewEncoder(cfgW).Encode(&cfg)
	cfgW.Close()

	go func() {
		cmd.Wait()
		t.ctl.Close()
		os.Remove(root)
		close(t.done)
	}()
	go func() {
		defer close(t.ready)
		buf := make([]byte, 4096)
		t.ctl.SetReadDeadline(time.Now().Add(2 * time.Minute))
		n, err := t.ctl.Read(buf)
		t.ctl.SetReadDeadline(time.Time{})
		var hello struct {
			Ready     bool     `json:"ready"`
			Preloaded []string `json:"preloaded"`
		}
		if err == nil {
			err = json.Unmarshal(buf[:n], &hello)
		}
		if err != nil || !hello.Ready {
			cmd.Process.Kill()
			t.err = fmt.Errorf("starting jail zygote: %v: %s", err, strings.TrimSpace(t.stderr.String()))
			return
		}
		b.log.Debug("jail zygote ready", "preload", key, "preloaded", hello.Preloaded)
	}()
	return t
}

func splitPreload(key string) []string {
	if key == "" {
		return nil
	}
	return strings.Split(key, ",")
}

// zygotePrefix names a template's mount point ("zygote-<server pid>-…").
func zygotePrefix(pid int) string { return "zygote-" + fmt.Sprint(pid) + "-" }

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

// close stops every template.
func (z *zygotes) close() {
	z.mu.Lock()
	z.closed = true
	all := z.byKey
	z.byKey = map[string]*template{}
	z.mu.Unlock()
	for _, t := range all {
		if t.cmd != nil && t.cmd.Process != nil {
			t.cmd.Process.Kill()
		}
		<-t.done
	}
}

// Close stops the backend's zygotes. Boxes already made are unaffected.
func (b *Backend) Close() error {
	if b.zy != nil {
		b.zy.close()
	}
	return nil
}

// forkBox makes a box from the zygote. It returns (nil, nil) when the
// zygote is off or not working, and Create then starts the box directly.
func (b *Backend) forkBox(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	if b.zy == nil {
		return nil, nil
	}
	t, err := b.zy.get(ctx, spec.Preload)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		b.log.Warn("jail zygote unavailable; starting the box directly", "err", err)
		return nil, nil
	}
	box, err := b.fork(ctx, t, spec)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		b.log.Warn("forking a box from the zygote; starting it directly", "err", err)
		return nil, nil
	}
	return box, nil
}

func (b *Backend) fork(ctx context.Context, t *template, spec sandbox.Spec) (_ sandbox.Sandbox, err error) {
	lim := spec.Limits.WithDefaults()
	start := time.Now()
	var cl cleanup
	defer func() {
		if err != nil {
			cl.run()
		}
	}()
	cg, err := b.cgroups.create(spec.ID, lim)
	if err != nil {
		return nil, err
	}
	cl.push(cg.destroy)

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
	cl.push(host.Close)
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
	// G, the box's PID 1, says 'c' first thing; it waits in the
	// template's namespaces until it is in the box's cgroup.
	pid, err := readHello(host, 'c')
	if err != nil {
		return nil, fail("waiting for the fork", err)
	}
	forked := time.Now()
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("watching the box's init: %w", err)
	}
	cl.push(func() error {
		defer unix.Close(pidfd)
		// The box's PID 1: its death ends the pid namespace.
		unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		for range 50 {
			if n, err := unix.Poll(fds, 100); n > 0 || (err != nil && !errors.Is(err, unix.EINTR)) {
				break
			}
		}
		return nil
	})
	if err := cg.add(pid); err != nil {
		return nil, err
	}
	if _, err := host.Write([]byte{'k'}); err != nil {
		return nil, fail("releasing the fork", err)
	}
	if rc, err := host.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) { unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PASSCRED, 0) })
	}
	host.SetReadDeadline(time.Time{})
	stop()

	var once sync.Once
	destroy := func() error {
		var err error
		once.Do(func() { err = cl.run() })
		return err
	}
	conn, err := sandbox.NewAgentConn(ctx, spec.ID, host, destroy)
	if err != nil {
		return nil, fail("starting the agent", err) // NewAgentConn destroyed the box
	}
	b.log.Debug("forked a box", "id", spec.ID, "cgroup", sent.Sub(start), "fork", forked.Sub(sent), "ready", time.Since(forked))
	return &jailBox{AgentConn: conn, cg: cg}, nil
}

// nextSlot picks the box's uid range; slot 0 holds the template's own
// root, so boxes never get it.
func (b *Backend) nextSlot() int {
	for {
		if n := int(b.slot.Add(1) % uidSlots); n != 0 {
			return n
		}
	}
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

// initZygotes turns the zygote on when Options.Zygote or KILN_JAIL_ZYGOTE
// asks for it, and removes the mount points of dead servers' templates.
func (b *Backend) initZygotes() {
	removeOrphanedZygoteDirs(b.opts.StateDir)
	on := b.opts.Zygote
	switch os.Getenv("KILN_JAIL_ZYGOTE") {
	case "1", "true":
		on = true
	case "0", "false":
		on = false
	}
	if !on {
		return
	}
	z, err := newZygotes(b)
	if err != nil {
		b.log.Warn("jail zygote off; every box starts its own python", "err", err)
		return
	}
	b.zy = z
}

// removeOrphanedZygoteDirs removes "zygote-<pid>-*" entries of servers no
// longer running. Their mounts lived in the dead templates' namespaces.
func removeOrphanedZygoteDirs(dir string) {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), "zygote-")
		if !ok || !e.IsDir() {
			continue
		}
		owner, _, _ := strings.Cut(rest, "-")
		var pid int
		if _, err := fmt.Sscan(owner, &pid); err != nil || pid <= 0 || processAlive(pid) {
			continue
		}
		os.Remove(dir + "/" + e.Name())
	}
}
