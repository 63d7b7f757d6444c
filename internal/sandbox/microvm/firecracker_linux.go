package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/agentproto"
	"kiln/internal/egress"
	"kiln/internal/guestinit"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// Firecracker is the Firecracker backend: like Backend, it restores every
// box from a template snapshot (Firecracker maps the memory file privately,
// so clones share it copy-on-write), but it talks to the agent over vsock.
type Firecracker struct {
	opts FirecrackerOptions
	log  *slog.Logger
	tpls *boxkit.TemplateCache[*fcTemplate]

	net *guestNet // every VM's network; nil: none (net_linux.go)

	mu     sync.Mutex
	live   map[*fcVM]struct{}
	closed bool
}

var (
	_ sandbox.Backend = (*Firecracker)(nil)
	_ sandbox.Checker = (*Firecracker)(nil)
	_ sandbox.Noter   = (*Firecracker)(nil)
)

// CheckFirecrackerHost checks what Firecracker needs of the host before
// any kernel or image: its binary (a name is looked up on $PATH) and a
// usable /dev/kvm. It returns the binary's path.
func CheckFirecrackerHost(bin string) (string, error) {
	if bin == "" {
		bin = "firecracker"
	}
	fc, err := exec.LookPath(bin)
	if err != nil {
		return "", fmt.Errorf("finding firecracker (install Firecracker, a release with vsock_override in its snapshot API, or pass --firecracker-bin): %w", err)
	}
	kvm, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrNoKVM, err)
	}
	return fc, kvm.Close()
}

// NewFirecracker checks opts and returns the backend.
func NewFirecracker(opts FirecrackerOptions) (*Firecracker, error) {
	if opts.Image == nil {
		return nil, ErrNoImage
	}
	if opts.Kernel == "" {
		return nil, errors.New("microvm: firecracker needs a vmlinux kernel with virtio-mmio, virtio-blk, vsock and ext4 built in")
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Firecracker == "" {
		opts.Firecracker = "firecracker"
	}
	fc, err := exec.LookPath(opts.Firecracker)
	if err != nil {
		return nil, fmt.Errorf("finding firecracker (install Firecracker, a release with vsock_override in its snapshot API, or pass --firecracker-bin): %w", err)
	}
	opts.Firecracker = fc
	net := newGuestNet(opts.Egress, opts.Policy)
	if os.Geteuid() != 0 {
		if net != nil {
			return nil, errors.New("microvm: firecracker with an egress policy needs root: its tap lives in a network namespace of its own")
		}
		opts.NoCgroup = true
	}
	if opts.BootTimeout == 0 {
		opts.BootTimeout = time.Minute
	}
	if err := vmmDirs("firecracker", &opts.StateDir, &opts.RunDir, &opts.Cgroup); err != nil {
		return nil, err
	}
	log := opts.Logger.With("backend", "firecracker")
	return &Firecracker{
		opts: opts,
		net:  net,
		log:  log,
		tpls: boxkit.NewTemplateCache(boxkit.TemplateOptions[*fcTemplate]{Name: "template", Logger: log}),
		live: map[*fcVM]struct{}{},
	}, nil
}

func (f *Firecracker) Name() string { return "firecracker" }

// Notes implements sandbox.Noter: what kiln doctor should say beside the
// check.
func (f *Firecracker) Notes() []string {
	jail := "firecracker runs without its jailer: kiln starts it in fresh net, ipc, uts and pid namespaces (QEMU's jail, jail_linux.go, does not apply to it)"
	if os.Geteuid() != 0 {
		jail = "firecracker runs without its jailer and, not as root, in the host's namespaces and cgroup"
	}
	return []string{
		jail,
		"the firecracker driver is tested against Firecracker's API spec with a fake server only, never against a real Firecracker",
	}
}

// Check implements sandbox.Checker: the kernel and image exist,
// firecracker runs, /dev/kvm opens, and a VM starts and runs a command.
func (f *Firecracker) Check(ctx context.Context) error {
	if err := f.checkHost(ctx); err != nil {
		return err
	}
	box, err := f.Create(ctx, sandbox.Spec{ID: "doctor"})
	if err != nil {
		return fmt.Errorf("starting a VM: %w", err)
	}
	defer box.Close()
	return sandbox.Probe(ctx, box)
}

// checkHost checks what a VM needs from the host, without starting one.
func (f *Firecracker) checkHost(ctx context.Context) error {
	for _, p := range []string{f.opts.Kernel, f.opts.Image.RootfsPath()} {
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("checking image: %w", err)
		}
	}
	if err := exec.CommandContext(ctx, f.opts.Firecracker, "--version").Run(); err != nil {
		return fmt.Errorf("running firecracker: %w", err)
	}
	kvm, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNoKVM, err)
	}
	kvm.Close()
	return checkTun(f.net)
}

// Create restores a clone of the template for spec's shape.
func (f *Firecracker) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	l := spec.Limits.WithDefaults()
	id := spec.ID
	if id == "" {
		id = randomID()
	}
	tt, err := f.template(ctx, l, cleanPreload(spec.Preload))
	if err != nil {
		return nil, err
	}
	defer f.tpls.Release(tt)
	tpl := tt.Value
	v, err := f.start(ctx, id, l)
	if err != nil {
		return nil, fmt.Errorf("restoring vm: %w", err)
	}
	if f.net != nil {
		// The snapshot names its tap (TapName); Firecracker opens it
		// in its namespace as it loads, where the attachment put it.
		if v.link, err = attachVM(ctx, f.opts.Egress, f.net, f.opts.Policy, v.cmd.Process.Pid, id); err != nil {
			v.destroy()
			return nil, fmt.Errorf("restoring vm: %w", err)
		}
	}
	err = v.api.loadSnapshot(ctx, fcSnapshotLoad{
		SnapshotPath:  filepath.Join(tpl.dir, "state"),
		MemBackend:    &fcMemBackend{BackendType: "File", BackendPath: filepath.Join(tpl.dir, "mem")},
		ResumeVM:      true,
		VsockOverride: &fcVsockOverride{UDSPath: v.vsockPath()},
	})
	if err != nil {
		v.destroy()
		return nil, fmt.Errorf("restoring vm: %w", err)
	}
	conn, err := dialAgentVsock(ctx, v.vsockPath())
	if err != nil {
		v.destroy()
		return nil, fmt.Errorf("restoring vm: %w", err)
	}
	v.defer_(closer(conn))
	sb, err := sandbox.RestoreConn(ctx, id, conn, tpl.hello, v.destroy, &sandbox.RestoreOptions{
		ReseedGuest: func(ctx context.Context) error { return reseedVsock(ctx, v.vsockPath(), v.link.seed()) },
	})
	if err != nil {
		return nil, err
	}
	return withLink(sb, v.link), nil
}

// reseedVsock sends the restored guest its seed (see vm.reseed) on
// guestinit's vsock seed port.
func reseedVsock(ctx context.Context, uds string, s guestinit.Seed) error {
	c, err := dialVsock(ctx, uds, guestinit.SeedVsockPort)
	if err != nil {
		return err
	}
	defer c.Close()
	return sendSeed(ctx, c, s)
}

// Close kills every live VM.
func (f *Firecracker) Close() error {
	f.mu.Lock()
	f.closed = true
	live := f.live
	f.live = map[*fcVM]struct{}{}
	f.mu.Unlock()
	var errs []error
	for v := range live {
		errs = append(errs, v.destroy())
	}
	f.tpls.Close()
	return errors.Join(append(errs, os.RemoveAll(f.opts.RunDir))...)
}

// dialAgentVsock connects to the agent's port, retrying while the guest
// has not started listening yet (or is being restored).
func dialAgentVsock(ctx context.Context, uds string) (net.Conn, error) {
	return dialVsock(ctx, uds, agentVsockPort)
}

// dialVsock connects to a guest's vsock port, retrying while the guest has
// not started listening yet (or is being restored).
func dialVsock(ctx context.Context, uds string, port uint32) (net.Conn, error) {
	for {
		c, err := fcConnectVsock(ctx, uds, port)
		if err == nil {
			return c, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("connecting to guest port %d: %w", port, errors.Join(err, ctx.Err()))
		case <-time.After(10 * time.Millisecond):
		}
	}
}

type fcVM struct {
	dir     string
	link    *vmLink // the box's attachment; nil without a network (and in a template)
	cmd     *exec.Cmd
	api     *fcClient
	exited  chan struct{}
	cleanup boxkit.Cleanup
}

func (v *fcVM) vsockPath() string      { return filepath.Join(v.dir, "v.sock") }
func (v *fcVM) defer_(fn func() error) { v.cleanup.Add(fn) }
func (v *fcVM) apiPath() string        { return filepath.Join(v.dir, "api.sock") }

// destroy kills Firecracker and undoes everything start did, once.
func (v *fcVM) destroy() error { return v.cleanup.Run() }

// fcID is what Firecracker accepts as an instance id.
var fcID = regexp.MustCompile(`[^A-Za-z0-9-]`)

// start runs a Firecracker process with its API socket, in its own cgroup
// and namespaces, and waits for the API.
func (f *Firecracker) start(ctx context.Context, id string, l sandbox.Limits) (_ *fcVM, err error) {
	f.mu.Lock()
	closed := f.closed
	f.mu.Unlock()
	if closed {
		return nil, sandbox.ErrClosed
	}
	v := &fcVM{dir: filepath.Join(f.opts.RunDir, id), exited: make(chan struct{})}
	defer func() {
		if err != nil {
			v.destroy()
		}
	}()
	v.defer_(func() error { return v.link.close() }) // last: Firecracker is gone
	v.defer_(func() error { return os.RemoveAll(v.dir) })
	if err := os.Mkdir(v.dir, 0o700); err != nil {
		return nil, err
	}
	fid := fcID.ReplaceAllString(id, "-")
	if len(fid) > 60 {
		fid = fid[:60]
	}
	cmd := exec.Command(f.opts.Firecracker, "--api-sock", v.apiPath(), "--id", fid)
	cmd.Env = []string{}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Pdeathsig:  syscall.SIGKILL,
		Setpgid:    true,
		Cloneflags: unix.CLONE_NEWNET | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS | unix.CLONE_NEWPID,
	}
	if os.Geteuid() != 0 {
		cmd.SysProcAttr.Cloneflags = 0
	}
	var cg *boxkit.CgroupGroup
	if !f.opts.NoCgroup {
		mem, _ := guestShape(l)
		if cg, err = newCgroup(f.opts.Cgroup, id, boxkit.CgroupLimits{MemoryBytes: mem<<20 + 64<<20, Pids: 64, CPUs: l.CPUs}); err != nil {
			return nil, err
		}
		v.defer_(cg.Destroy)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting firecracker: %w", err)
	}
	v.cmd = cmd
	go func() {
		cmd.Wait()
		close(v.exited)
	}()
	v.defer_(func() error {
		cmd.Process.Kill()
		<-v.exited
		return nil
	})
	if cg != nil {
		if err := cg.Add(cmd.Process.Pid); err != nil {
			return nil, err
		}
	}
	f.mu.Lock()
	f.live[v] = struct{}{}
	f.mu.Unlock()
	v.defer_(func() error {
		f.mu.Lock()
		delete(f.live, v)
		f.mu.Unlock()
		return nil
	})
	v.api = newFCClient(v.apiPath())
	if err := v.api.waitReady(ctx); err != nil {
		return nil, err
	}
	return v, nil
}

type fcTemplate struct {
	dir   string
	hello agentproto.Hello
}

// template returns the template for l and preload, loading it from
// StateDir or booting and saving it once; the caller releases it.
func (f *Firecracker) template(ctx context.Context, l sandbox.Limits, preload []string) (*boxkit.Template[*fcTemplate], error) {
	mem, cpus := guestShape(l)
	cmdline := kernelCmdline(l, f.net, preload, false, 0, "vsock", "init="+guestinit.AgentPath)
	if err := checkCmdline(cmdline); err != nil {
		return nil, err
	}
	b, _ := json.Marshal([]any{1, f.opts.Image.Key, f.opts.Kernel, mem, cpus, cmdline, f.net != nil})
	key := hashKey(b)
	tt, err := f.tpls.Get(ctx, key, func(ctx context.Context, _ bool) (*fcTemplate, time.Time, error) {
		t := &fcTemplate{dir: filepath.Join(f.opts.StateDir, "tpl-"+key)}
		if h, err := loadHello(filepath.Join(t.dir, "hello"), guestPlan(l, f.net).Digest()); err == nil {
			t.hello = h
			return t, time.Time{}, nil
		}
		ctx, cancel := context.WithTimeout(ctx, f.opts.BootTimeout)
		defer cancel()
		return t, time.Time{}, f.saveTemplate(ctx, t, l, mem, cpus, cmdline)
	})
	if err != nil {
		return nil, fmt.Errorf("making template: %w", err)
	}
	return tt, nil
}

// saveTemplate boots a VM through the API, waits for the agent's hello over
// vsock, pauses it and writes a full snapshot.
func (f *Firecracker) saveTemplate(ctx context.Context, t *fcTemplate, l sandbox.Limits, mem int64, cpus int, cmdline string) error {
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
	v, err := f.start(ctx, "template-"+filepath.Base(t.dir), l)
	if err != nil {
		return fmt.Errorf("booting vm: %w", err)
	}
	defer v.destroy()
	var hello agentproto.Hello
	steps := []step{
		{"machine config", func(ctx context.Context) error {
			return v.api.machineConfig(ctx, fcMachineConfig{VcpuCount: cpus, MemSizeMiB: mem})
		}},
		{"boot source", func(ctx context.Context) error {
			return v.api.bootSource(ctx, fcBootSource{KernelImagePath: f.opts.Kernel, BootArgs: cmdline})
		}},
		{"root drive", func(ctx context.Context) error {
			return v.api.drive(ctx, fcDrive{DriveID: "rootfs", PathOnHost: f.opts.Image.RootfsPath(), IsRootDevice: true, IsReadOnly: true})
		}},
		{"vsock", func(ctx context.Context) error {
			return v.api.vsock(ctx, fcVsock{GuestCID: 3, UDSPath: v.vsockPath()})
		}},
		{"network", func(ctx context.Context) error {
			if f.net == nil {
				return nil
			}
			// A tap leading nowhere: the template has no box, and its
			// clones get their own attachment's (Create).
			_, closeTap, err := egress.LooseTap(v.cmd.Process.Pid)
			if err != nil {
				return err
			}
			v.defer_(closeTap)
			return v.api.networkInterface(ctx, fcNetworkInterface{IfaceID: "eth0", HostDevName: egress.TapName, GuestMAC: guestMAC})
		}},
		{"entropy", v.api.entropy},
		{"start", func(ctx context.Context) error { return v.api.action(ctx, "InstanceStart") }},
		{"wait for agent", func(ctx context.Context) error {
			conn, err := dialAgentVsock(ctx, v.vsockPath())
			if err != nil {
				return err
			}
			defer conn.Close()
			stop := context.AfterFunc(ctx, func() { conn.Close() })
			defer stop()
			hello, err = readHello(conn, guestPlan(l, f.net).Digest())
			return err
		}},
		{"pause", func(ctx context.Context) error { return v.api.setState(ctx, "Paused") }},
		{"snapshot", func(ctx context.Context) error {
			return v.api.createSnapshot(ctx, fcSnapshotCreate{SnapshotType: "Full",
				SnapshotPath: filepath.Join(tmp, "state"), MemFilePath: filepath.Join(tmp, "mem")})
		}},
	}
	if err := runSteps(ctx, f.log, steps); err != nil {
		return err
	}
	if err := writeHello(filepath.Join(tmp, "hello"), hello); err != nil {
		return err
	}
	if err := os.Rename(tmp, t.dir); err != nil {
		return fmt.Errorf("storing template: %w", err)
	}
	ok = true
	t.hello = hello
	return nil
}
