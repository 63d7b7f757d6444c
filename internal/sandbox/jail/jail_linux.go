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
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
	"kiln/internal/boxtemplate"
	"kiln/internal/egress"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// Backend creates jails.
type Backend struct {
	opts     Options
	log      *slog.Logger
	cgroups  *cgroups // nil: no cgroup limits on this host
	cgErr    error
	rootless bool                   // not root on the host
	sub      *subIDs                // rootless with subordinate ids: a uid per box; nil: code shares the user's
	subErr   error                  // why sub is nil, rootless
	slots    *boxpolicy.UIDSlots    // the boxes' host uid ranges (newUIDSlots)
	zy       *zygotes               // nil: every box starts its own python
	zyOff    *string                // with zy nil, the note that says why (madeNote)
	made     atomic.Pointer[string] // how the last box was made, and why (madeNote)
}

var (
	_ sandbox.Backend   = (*Backend)(nil)
	_ sandbox.Checker   = (*Backend)(nil)
	_ sandbox.Describer = (*Backend)(nil)
	_ sandbox.Noter     = (*Backend)(nil)

	_ sandbox.OOMReporter     = (*jailBox)(nil)
	_ sandbox.LimitReporter   = (*jailBox)(nil)
	_ sandbox.RefusalReporter = (*jailBox)(nil)
)

// The host uids of boxes are boxpolicy.JailUIDs: box uid 0..65535 of the
// box in slot n maps to uidBase + n*65536 + …, ranges no real user or
// /etc/subuid entry has. A box's files and processes on the host belong to
// nobody, so even a box that mapped to "root" inside could not read a
// root-only host file. Slots are handed out from 1 on: the first uid of
// slot 0, uidBase, is the zygote template's.
const uidRange = 65536

var uidBase = int(boxpolicy.JailUIDs.First)

// newUIDSlots is the allocator of a backend's slots.
func newUIDSlots() *boxpolicy.UIDSlots {
	return &boxpolicy.UIDSlots{Range: boxpolicy.JailUIDs, Size: uidRange, Reserved: 1}
}

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
	if err := prepareTemplate(&opts); err != nil {
		return nil, err
	}
	// Box roots are uids no one has: they must be able to traverse to
	// their mount point (and nothing else lives here).
	if opts.StateDir == "" {
		dir, err := boxkit.StateDir(stateDirName(), 0o711)
		if err != nil {
			return nil, err
		}
		opts.StateDir = dir
	} else if err := boxkit.OwnDir(opts.StateDir, 0o711); err != nil {
		return nil, err
	}
	b := &Backend{opts: opts, log: opts.Logger, rootless: os.Getuid() != 0, slots: newUIDSlots()}
	// A template's setup box, rootless, runs its code as the user: what
	// it writes must be the user's for Commit to seal it (a user cannot
	// chown a subordinate uid's files). The setup is the operator's code.
	if b.rootless && !opts.TemplateWritable {
		if b.sub, b.subErr = detectSubIDs(); b.subErr != nil {
			b.log.Warn("rootless boxes without their own uid: code runs as the agent's", "err", b.subErr)
		}
	}
	b.cgroups, b.cgErr = detectCgroups(opts.AllBoxes, b.rootless)
	if b.cgErr != nil {
		b.log.Warn("no cgroup limits: boxes are bounded by rlimits only", "err", b.cgErr)
	} else {
		n, err := b.cgroups.removeOrphans()
		if n > 0 {
			b.log.Info("removed orphaned cgroups of a previous kiln", "count", n)
		}
		if err != nil {
			b.log.Warn("removing orphaned cgroups of a previous kiln", "err", err)
		}
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
	// From the template of the servers' default preloads, so that the
	// notes say how the boxes a server makes by default are made
	// (madeNote); a box started directly does not import them.
	spec := sandbox.Spec{ID: "doctor"}
	if b.zy != nil {
		spec.Preload = sandbox.DefaultPreload
	}
	box, err := b.Create(ctx, spec)
	if err != nil {
		if b.rootless {
			if uerr := userNamespaceControl(); uerr != nil {
				return uerr
			}
		}
		return err
	}
	defer box.Close()
	res, err := box.RunShell(ctx, "id -u", sandbox.ExecOptions{})
	if err != nil {
		return err
	}
	if strings.TrimSpace(res.Stdout.Text) == "0" && !b.sharedUID() {
		return errors.New("code in the box runs as uid 0")
	}
	var weaker []error
	if b.sharedUID() {
		weaker = append(weaker, fmt.Errorf("code runs as your own uid, the agent's, and can signal it (kill or stop its own box): %w", b.subErr))
	}
	if b.cgErr != nil {
		weaker = append(weaker, fmt.Errorf("no cgroup limits: %w", b.cgErr))
	}
	if len(weaker) > 0 {
		return fmt.Errorf("works, but %w", errors.Join(weaker...))
	}
	return nil
}

// Notes say, rootless, what the boxes share with each other and with the
// user (doctor prints them).
func (b *Backend) Notes() []string {
	var notes []string
	if m := b.made.Load(); m != nil {
		notes = append(notes, *m)
	}
	if !b.rootless {
		return notes
	}
	uid := os.Getuid()
	notes = append(notes,
		fmt.Sprintf("rootless: a box's root (its agent) is you, uid %d, in the box's own user namespace; the zygote is off (it needs root)", uid),
		fmt.Sprintf("rootless: every box's user namespace is owned by uid %d, so the per-user kernel counts of all boxes (user namespaces, inotify instances and watches, POSIX message-queue bytes, queued signals, locked memory) are charged to you together, with your own processes; as root, each box is charged to a host uid of its own", uid),
	)
	if b.sub != nil {
		first, _ := b.sub.forSlot(1)
		notes = append(notes, fmt.Sprintf("rootless: code runs as box uid %d, a subordinate uid of yours from %d on, one per box (%d, then they wrap); boxes' processes count against RLIMIT_NPROC of that uid only", boxUID, first, min(b.sub.n, int64(b.slots.Slots()-b.slots.Reserved))))
	} else {
		notes = append(notes, fmt.Sprintf("rootless: code runs as your uid %d, like its agent, so RLIMIT_NPROC counts your own processes too", uid))
	}
	if b.cgroups != nil {
		notes = append(notes, "rootless: boxes' cgroups are under "+b.cgroups.fs.Root()+", with kiln and the process that started it moved into its "+boxkit.DelegateLeaf+" group")
	}
	return notes
}

// sharedUID reports whether code runs as the uid of its agent: rootless,
// without subordinate ids, a box maps only the user's own uid.
func (b *Backend) sharedUID() bool { return b.rootless && b.sub == nil }

// madeNote is a note on how boxes are made, for Notes (kiln doctor says
// which strategy this host gets, and why). The notes of the paths every
// box takes are made once (zyOff, template.made); a box's Create only
// stores the pointer.
func madeNote(format string, args ...any) *string {
	n := "boxes: " + fmt.Sprintf(format, args...)
	return &n
}

// Create starts a box and waits for its agent.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (_ sandbox.Sandbox, err error) {
	if box, err := b.forkBox(ctx, &spec); box != nil || err != nil {
		return box, err // from the zygote (zygote_linux.go)
	}
	if b.zy == nil {
		b.made.Store(b.zyOff)
	}
	lim := spec.Limits.WithDefaults()
	var cl boxkit.Cleanup
	defer func() {
		if err != nil {
			cl.Run()
		}
	}()

	var cg *boxkit.CgroupGroup
	if b.cgroups != nil {
		if cg, err = b.cgroups.create(spec.ID, lim); err != nil {
			return nil, err
		}
		cl.Add(cg.Destroy)
	}
	root, err := os.MkdirTemp(b.opts.StateDir, statePrefix())
	if err != nil {
		return nil, fmt.Errorf("creating mount point: %w", err)
	}
	cl.Add(func() error { return os.Remove(root) })
	if err := os.Chmod(root, 0o711); err != nil {
		return nil, err
	}

	proc, err := b.startInit(&cl)
	if err != nil {
		return nil, err
	}
	defer proc.cfg.Close()
	if b.opts.TemplateWritable && !b.rootless {
		// The setup's box alone may write the template's files: they
		// are its code user's (boxtemplate.Stage).
		if err := boxtemplate.HandTo(b.opts.Template, proc.owner+boxpolicy.UID, proc.owner+boxpolicy.GID); err != nil {
			return nil, err
		}
	}

	if cg != nil {
		if err := cg.Add(proc.cmd.Process.Pid); err != nil {
			return nil, err
		}
	}
	env, resolvConf, trust := b.netEnv()
	att, err := b.attach(ctx, proc.cmd.Process.Pid, spec.ID, &cl)
	if err != nil {
		return nil, err
	}
	cfg := initConfig{
		Root:        root,
		Agent:       b.opts.Agent,
		AgentArgs:   b.agentArgs(spec),
		Plan:        b.directPlan(lim, env),
		ResolvConf:  resolvConf,
		TrustBundle: trust,
		Rootless:    b.sharedUID(),
		Template:    b.opts.Template,
		TemplateRW:  b.opts.TemplateWritable,
	}
	if err := json.NewEncoder(proc.cfg).Encode(&cfg); err != nil {
		return nil, fmt.Errorf("sending box config: %w", err)
	}
	proc.cfg.Close()

	conn, err := sandbox.NewAgentConn(ctx, spec.ID, proc.host, cl.Run)
	if err != nil {
		<-proc.waited
		if msg := strings.TrimSpace(proc.stderr.String()); msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
		return nil, fmt.Errorf("starting jail: %w", err)
	}
	b.log.Debug("started a box", "id", spec.ID, "path", "direct")
	return &jailBox{AgentConn: conn, cg: cg, egress: att}, nil
}

// boxInit is a box's init as startInit leaves it: running in the box's new
// namespaces, waiting for its configuration on cfg.
type boxInit struct {
	cmd    *exec.Cmd
	host   *os.File // the server's end of the agent socket
	cfg    *os.File // where the init reads its configuration; the caller closes it
	stderr *tailBuffer
	waited chan struct{} // closed once the init is reaped
	owner  int           // the host uid (and gid) of the box's root
}

// startInit starts a box's init (this executable, InitArg) in new
// namespaces, owned by the box's host uid, and pushes onto cl what kills
// it and closes the agent socket.
func (b *Backend) startInit(cl *boxkit.Cleanup) (_ *boxInit, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("creating agent socket: %w", err)
	}
	host := os.NewFile(uintptr(fds[0]), "agent-host")
	box := os.NewFile(uintptr(fds[1]), "agent-box")
	cl.Add(host.Close)
	cfgR, cfgW, err := os.Pipe()
	if err != nil {
		box.Close()
		return nil, err
	}
	defer cfgR.Close()
	defer func() {
		if err != nil {
			cfgW.Close()
		}
	}()

	// Exec the init through an open fd: the box's uid may not traverse
	// the directories above the binary (a 0700 build dir, say).
	self, err := os.Open(b.opts.Self)
	if err != nil {
		box.Close()
		return nil, fmt.Errorf("opening own executable: %w", err)
	}
	defer self.Close()
	stderr := &tailBuffer{max: 4096}
	cmd := exec.Command("/proc/self/fd/4", InitArg)
	cmd.Env = []string{}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = box, box, stderr
	cmd.ExtraFiles = []*os.File{cfgR, self}
	var owner, slot int
	cmd.SysProcAttr, owner, slot = b.procAttr()
	if b.sub != nil {
		cmd.Args = append(cmd.Args, awaitIDsArg)
	}
	if b.rootless {
		err = cmd.Start()
	} else {
		err = startAsOwner(cmd, owner)
	}
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
	cl.Add(kill)
	if b.sub != nil {
		if err := b.sub.mapBox(cmd.Process.Pid, slot); err != nil {
			return nil, err
		}
		if _, err := cfgW.Write([]byte{'\n'}); err != nil {
			return nil, fmt.Errorf("releasing the mapped init: %w", err)
		}
	}
	return &boxInit{cmd: cmd, host: host, cfg: cfgW, stderr: stderr, waited: waited, owner: owner}, nil
}

// procAttr is how the box's init starts, the host uid that owns its user
// namespace (the box's root), and the box's uid slot. Rootless with
// subordinate ids, the init starts unmapped, as itself, and startInit maps
// it (subids_linux.go).
func (b *Backend) procAttr() (*syscall.SysProcAttr, int, int) {
	attr := &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS | syscall.CLONE_NEWPID |
			syscall.CLONE_NEWNET | syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS,
		Pdeathsig:                  syscall.SIGKILL,
		GidMappingsEnableSetgroups: false,
		// Become uid 0 of the new namespace before exec, so the init
		// holds capabilities there (and only there) to build the root.
		Credential: &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true},
	}
	slot := b.nextSlot()
	switch {
	case b.sub != nil:
		attr.Credential = nil
		return attr, os.Getuid(), slot
	case b.rootless:
		attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}}
		attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}}
		return attr, os.Getuid(), slot
	}
	base := b.slots.First(slot)
	attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: uidRange}}
	attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: uidRange}}
	return attr, base, slot
}

// startAsOwner starts cmd, whose SysProcAttr creates a user namespace,
// from a thread whose real and effective uid and gid are owner: the kernel
// makes the namespace's creator its owner, and charges every per-user
// count of the processes inside (inotify instances, user namespaces,
// message queue bytes, queued signals, processes) to that owner at the
// host's level, so each box has its own quota instead of sharing root's.
//
// The thread keeps saved uid 0 and raises its permitted capabilities
// again, to write the id maps; it gets its ids back before it runs
// anything else. Credentials set with raw syscalls belong to one thread
// only, which is what lets a multithreaded server do this at all.
func startAsOwner(cmd *exec.Cmd, owner int) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		restore, err := becomeOwner(owner)
		if err != nil {
			errc <- fmt.Errorf("becoming the box's owner: %w", err)
			return // the thread ends locked, with whatever ids it has
		}
		err = cmd.Start()
		if rerr := restore(); rerr != nil {
			// The box's parent-death signal is tied to this thread: it
			// dies with it, as the thread must.
			if err == nil {
				cmd.Process.Kill()
				cmd.Wait()
			}
			errc <- fmt.Errorf("restoring the server's ids: %w", rerr)
			return
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

// becomeOwner gives this (locked) thread uid and gid owner, real and
// effective, with its capabilities still effective, and returns how to undo
// it.
func becomeOwner(owner int) (restore func() error, err error) {
	var ru, eu, su, rg, eg, sg uint32
	unix.RawSyscall(unix.SYS_GETRESUID, uintptr(unsafe.Pointer(&ru)), uintptr(unsafe.Pointer(&eu)), uintptr(unsafe.Pointer(&su)))
	unix.RawSyscall(unix.SYS_GETRESGID, uintptr(unsafe.Pointer(&rg)), uintptr(unsafe.Pointer(&eg)), uintptr(unsafe.Pointer(&sg)))
	groups, err := unix.Getgroups()
	if err != nil {
		return nil, err
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var caps [2]unix.CapUserData
	if err := unix.Capget(&hdr, &caps[0]); err != nil {
		return nil, fmt.Errorf("capget: %w", err)
	}
	restore = func() error {
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, uintptr(ru), uintptr(eu), uintptr(su)); e != 0 {
			return fmt.Errorf("setresuid: %w", e)
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, uintptr(rg), uintptr(eg), uintptr(sg)); e != 0 {
			return fmt.Errorf("setresgid: %w", e)
		}
		gids := make([]uint32, len(groups))
		for i, g := range groups {
			gids[i] = uint32(g)
		}
		var p unsafe.Pointer
		if len(gids) > 0 {
			p = unsafe.Pointer(&gids[0])
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, uintptr(len(gids)), uintptr(p), 0); e != 0 {
			return fmt.Errorf("setgroups: %w", e)
		}
		if err := unix.Capset(&hdr, &caps[0]); err != nil {
			return fmt.Errorf("capset: %w", err)
		}
		var nru, neu, nsu uint32
		unix.RawSyscall(unix.SYS_GETRESUID, uintptr(unsafe.Pointer(&nru)), uintptr(unsafe.Pointer(&neu)), uintptr(unsafe.Pointer(&nsu)))
		if nru != ru || neu != eu || nsu != su {
			return errors.New("the thread's uids did not come back")
		}
		return nil
	}
	keep := uintptr(^uint32(0)) // -1: leave the saved id as it is
	if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 0, 0, 0); e != 0 {
		return nil, fmt.Errorf("setgroups: %w", e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, uintptr(owner), uintptr(owner), keep); e != 0 {
		restore()
		return nil, fmt.Errorf("setresgid: %w", e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, uintptr(owner), uintptr(owner), keep); e != 0 {
		restore()
		return nil, fmt.Errorf("setresuid: %w", e)
	}
	// The uid change cleared the effective set; the saved uid 0 kept the
	// permitted one.
	if err := unix.Capset(&hdr, &caps[0]); err != nil {
		restore()
		return nil, fmt.Errorf("capset: %w", err)
	}
	return restore, nil
}

func (b *Backend) agentArgs(spec sandbox.Spec) []string {
	args := []string{"-workspace", boxpolicy.Workspace, "-preload", strings.Join(spec.Preload, ",")}
	if !b.sharedUID() {
		// The agent stays root of the box (agentCaps); code runs as boxUID.
		args = append(args, "-uid", strconv.Itoa(boxUID), "-gid", strconv.Itoa(boxGID))
	}
	if _, err := os.Stat(b.opts.Python); err == nil {
		args = append(args, "-python", b.opts.Python)
	} else {
		args = append(args, "-python", "")
	}
	return args
}

func (b *Backend) env() []string {
	env := append(slices.Clone(boxpolicy.Env), boxpolicy.UserEnv(boxUID)...)
	return append(env, b.opts.Env...)
}

// networked says whether the backend's boxes are attached to the egress
// gateway.
func (b *Backend) networked() bool { return b.opts.Egress != nil && !b.opts.Policy.Empty() }

// netEnv is a box's environment with what the gateway gives every box
// under the backend's policy, its resolv.conf and the CA bundle it trusts
// ("" for none): the same for every box, so the zygote's template holds
// the files and each fork's plan the environment.
func (b *Backend) netEnv() (env []string, resolvConf, trust string) {
	env = b.env()
	if !b.networked() {
		return env, "", ""
	}
	s := b.opts.Egress.BoxSetup(b.opts.Policy)
	env = append(env, s.Env...)
	if len(s.TrustBundle) > 0 {
		env = append(env, egress.TrustEnv(boxpolicy.TrustBundle)...)
	}
	return env, s.ResolvConf, string(s.TrustBundle)
}

// attach links the network namespace of the box whose process is pid to
// the egress gateway, closing the link with cl; nil without a network.
func (b *Backend) attach(ctx context.Context, pid int, id string, cl *boxkit.Cleanup) (*egress.Attachment, error) {
	if !b.networked() {
		return nil, nil
	}
	att, err := b.opts.Egress.Attach(ctx, pid, egress.BoxInfo{Session: id, Policy: b.opts.Policy})
	if err != nil {
		return nil, fmt.Errorf("attaching egress gateway: %w", err)
	}
	cl.Add(att.Close)
	return att, nil
}

// jailBox adds what only the jail knows to the agent connection.
type jailBox struct {
	*sandbox.AgentConn
	cg     *boxkit.CgroupGroup
	egress *egress.Attachment // nil without network
}

// A jail box saves and loads state-level snapshots through its agent.
var (
	_ sandbox.Snapshotter = (*jailBox)(nil)
	_ sandbox.StateLoader = (*jailBox)(nil)
)

// NetworkRefusals says which connections the egress policy refused since
// the last call, in words for the model.
func (j *jailBox) NetworkRefusals() []string { return j.egress.NetworkRefusals() }

// OOMKilled reports whether the box hit its memory limit.
func (j *jailBox) OOMKilled() bool { return j.cg != nil && j.cg.OOMKills() > 0 }

// LimitHits counts the box cgroup's OOM kills and refused forks.
func (j *jailBox) LimitHits() sandbox.LimitHits {
	if j.cg == nil {
		return sandbox.LimitHits{OOMKills: -1, PidsRefused: -1}
	}
	return sandbox.LimitHits{OOMKills: j.cg.OOMKills(), PidsRefused: j.cg.PidsRefused()}
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
