package jail

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
)

// Backend creates jails.
type Backend struct {
	opts     Options
	log      *slog.Logger
	cgroups  *cgroups // nil: no cgroup limits on this host
	cgErr    error
	rootless bool
	slot     atomic.Uint32
	zy       *zygotes // nil: every box starts its own python
}

var (
	_ sandbox.Backend   = (*Backend)(nil)
	_ sandbox.Checker   = (*Backend)(nil)
	_ sandbox.Describer = (*Backend)(nil)
)

// uidBase is where the host uids of boxes start: box uid 0..65535 of the
// n-th box maps to uidBase + n*65536 + …, ranges no real user or
// /etc/subuid entry has. A box's files and processes on the host belong to
// nobody, so even a box that mapped to "root" inside could not read a
// root-only host file.
const (
	uidBase  = 1 << 30
	uidSlots = 4096
	uidRange = 65536
)

// New checks the host and returns the backend.
func New(opts Options) (*Backend, error) {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Agent == "" {
		p, err := FindAgent()
		if err != nil {
			return nil, fmt.Errorf("finding kiln-agent (build it with `make build`, or pass --agent): %w", err)
		}
		opts.Agent = p
	}
	if opts.Self == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("finding own executable: %w", err)
		}
		opts.Self = exe
	}
	if opts.Python == "" {
		opts.Python = "/usr/bin/python3"
	}
	if opts.StateDir == "" {
		opts.StateDir = os.TempDir() + "/kiln-jail"
	}
	// Box roots are uids no one has: they must be able to traverse to
	// their mount point (and nothing else lives here).
	if err := os.MkdirAll(opts.StateDir, 0o711); err != nil {
		return nil, fmt.Errorf("creating state dir: %w", err)
	}
	if err := os.Chmod(opts.StateDir, 0o711); err != nil {
		return nil, fmt.Errorf("creating state dir: %w", err)
	}
	b := &Backend{opts: opts, log: opts.Logger, rootless: os.Getuid() != 0}
	b.cgroups, b.cgErr = detectCgroups()
	if b.cgErr != nil {
		b.log.Warn("no cgroup limits: boxes are bounded by rlimits only", "err", b.cgErr)
	} else if n := b.cgroups.removeOrphans(); n > 0 {
		b.log.Info("removed orphaned boxes of a previous kiln", "count", n)
	}
	b.removeOrphanedState()
	b.initZygotes()
	return b, nil
}

func (b *Backend) Name() string { return "jail" }

// Runtime describes the python inside boxes (it is the host's).
func (b *Backend) Runtime() sandbox.Runtime {
	return sandbox.HostRuntime(b.opts.Python)
}

// Check starts a box and runs a command in it.
func (b *Backend) Check(ctx context.Context) error {
	box, err := b.Create(ctx, sandbox.Spec{ID: "doctor"})
	if err != nil {
		return err
	}
	defer box.Close()
	res, err := box.RunShell(ctx, "id -u", sandbox.ExecOptions{})
	if err != nil {
		return err
	}
	if strings.TrimSpace(res.Stdout.Text) == "0" && !b.rootless {
		return errors.New("code in the box runs as uid 0")
	}
	if b.cgErr != nil {
		return fmt.Errorf("works, but without cgroup limits: %w", b.cgErr)
	}
	return nil
}

// Create starts a box and waits for its agent.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (_ sandbox.Sandbox, err error) {
	if box, err := b.forkBox(ctx, spec); box != nil || err != nil {
		return box, err // from the zygote (zygote_linux.go)
	}
	lim := spec.Limits.WithDefaults()
	var cl cleanup
	defer func() {
		if err != nil {
			cl.run()
		}
	}()

	var cg *cgroup
	if b.cgroups != nil {
		if cg, err = b.cgroups.create(spec.ID, lim); err != nil {
			return nil, err
		}
		cl.push(cg.destroy)
	}
	root, err := os.MkdirTemp(b.opts.StateDir, statePrefix(os.Getpid()))
	if err != nil {
		return nil, fmt.Errorf("creating mount point: %w", err)
	}
	cl.push(func() error { return os.Remove(root) })
	if err := os.Chmod(root, 0o711); err != nil {
		return nil, err
	}

	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("creating agent socket: %w", err)
	}
	host := os.NewFile(uintptr(fds[0]), "agent-host")
	box := os.NewFile(uintptr(fds[1]), "agent-box")
	cl.push(host.Close)
	cfgR, cfgW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer cfgR.Close()
	defer cfgW.Close()

	// Exec the init through an open fd: the box's uid may not traverse
	// the directories above the binary (a 0700 build dir, say).
	self, err := os.Open(b.opts.Self)
	if err != nil {
		return nil, fmt.Errorf("opening own executable: %w", err)
	}
	defer self.Close()
	stderr := &tailBuffer{max: 4096}
	cmd := exec.Command("/proc/self/fd/4", InitArg)
	cmd.Env = []string{}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = box, box, stderr
	cmd.ExtraFiles = []*os.File{cfgR, self}
	cmd.SysProcAttr = b.procAttr()
	err = cmd.Start()
	box.Close() // the box holds its end now; ours would hide its EOF
	if err != nil {
		return nil, fmt.Errorf("starting box init: %w", err)
	}
	waited := make(chan struct{})
	go func() { cmd.Wait(); close(waited) }()
	kill := func() error {
		cmd.Process.Kill() // PID 1 of the box: the kernel kills the rest
		<-waited
		return nil
	}
	cl.push(kill)

	if cg != nil {
		if err := cg.add(cmd.Process.Pid); err != nil {
			return nil, err
		}
	}
	env := b.env()
	resolvConf := ""
	var att *egress.Attachment
	if b.opts.Egress != nil && !b.opts.Policy.Empty() {
		att, err = b.opts.Egress.Attach(ctx, cmd.Process.Pid, egress.BoxInfo{Session: spec.ID, Policy: b.opts.Policy})
		if err != nil {
			return nil, fmt.Errorf("attaching egress gateway: %w", err)
		}
		cl.push(att.Close)
		env = append(env, att.Env()...)
		resolvConf = att.ResolvConf()
	}
	cfg := initConfig{
		Root:       root,
		Agent:      b.opts.Agent,
		AgentArgs:  b.agentArgs(spec),
		Env:        env,
		Hostname:   "kiln",
		ResolvConf: resolvConf,
		Rootless:   b.rootless,
		Workspace:  lim.WorkspaceBytes,
		Tmp:        lim.TmpBytes,
		Inodes:     lim.Inodes,
		Pids:       lim.Pids,
		OpenFiles:  lim.OpenFiles,
	}
	if err := json.NewEncoder(cfgW).Encode(&cfg); err != nil {
		return nil, fmt.Errorf("sending box config: %w", err)
	}
	cfgW.Close()

	var once sync.Once
	destroy := func() error {
		var err error
		once.Do(func() { err = cl.run() })
		return err
	}
	conn, err := sandbox.NewAgentConn(ctx, spec.ID, host, destroy)
	if err != nil {
		<-waited
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
		return nil, fmt.Errorf("starting jail: %w", err)
	}
	return &jailBox{AgentConn: conn, cg: cg, egress: att}, nil
}

func (b *Backend) procAttr() *syscall.SysProcAttr {
	attr := &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS | syscall.CLONE_NEWPID |
			syscall.CLONE_NEWNET | syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS,
		Pdeathsig:                  syscall.SIGKILL,
		GidMappingsEnableSetgroups: false,
		// Become uid 0 of the new namespace before exec, so the init
		// holds capabilities there (and only there) to build the root.
		Credential: &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true},
	}
	if b.rootless {
		attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}}
		attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}}
		return attr
	}
	base := uidBase + int(b.slot.Add(1)%uidSlots)*uidRange
	attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: uidRange}}
	attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: uidRange}}
	return attr
}

func (b *Backend) agentArgs(spec sandbox.Spec) []string {
	args := []string{"-workspace", "/work", "-preload", strings.Join(spec.Preload, ",")}
	if _, err := os.Stat(b.opts.Python); err == nil {
		args = append(args, "-python", b.opts.Python)
	} else {
		args = append(args, "-python", "")
	}
	return args
}

func (b *Backend) env() []string {
	env := []string{
		"PATH=/usr/local/bin:/usr/bin:/bin",
		"HOME=/work",
		"USER=" + boxUser,
		"LOGNAME=" + boxUser,
		"LANG=C.UTF-8",
		"TMPDIR=/tmp",
		"MPLCONFIGDIR=/tmp/.matplotlib",
		"XDG_CACHE_HOME=/tmp/.cache", // fontconfig and friends stay out of /work
	}
	return append(env, b.opts.Env...)
}

// jailBox adds what only the jail knows to the agent connection.
type jailBox struct {
	*sandbox.AgentConn
	cg     *cgroup
	egress *egress.Attachment // nil without network
}

// NetworkRefusals says which connections the egress policy refused since
// the last call, in words for the model.
func (j *jailBox) NetworkRefusals() []string {
	if j.egress == nil {
		return nil
	}
	var out []string
	for _, r := range j.egress.Refusals() {
		out = append(out, r.String())
	}
	return out
}

// OOMKilled reports whether the box hit its memory limit.
func (j *jailBox) OOMKilled() bool { return j.cg != nil && j.cg.oomKilled() }

// cleanup is a LIFO stack of teardown steps, run once.
type cleanup struct{ steps []func() error }

func (c *cleanup) push(f func() error) { c.steps = append(c.steps, f) }

func (c *cleanup) run() error {
	var errs []error
	for i := len(c.steps) - 1; i >= 0; i-- {
		errs = append(errs, c.steps[i]())
	}
	c.steps = nil
	return errors.Join(errs...)
}

// tailBuffer keeps the last max bytes written (the init's error message).
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = t.b[len(t.b)-t.max:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(bytes.ToValidUTF8(t.b, []byte("?")))
}
