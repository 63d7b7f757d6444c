package gvisor

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
	"kiln/internal/egress"
	"kiln/internal/sandbox/boxkit"
)

var randReader = rand.Reader

// selfOwner is the stamp of this process, in the names of what it leaves
// on the host (a variable so that a test can pose as a dead process).
var selfOwner = boxkit.Self

// Teardown timeouts: each step gets this long before the next, harsher one.
// exitGrace is how long a box whose stream has closed gets to end by
// itself.
const (
	exitGrace   = 500 * time.Millisecond
	killGrace   = 3 * time.Second
	deleteGrace = 10 * time.Second
)

// box is one runsc container (its own sandbox) and what it holds on the host.
type box struct {
	b       *Backend
	cid     string
	dir     string // everything of the box on the host: bundle, runsc root, logs
	state   string // runsc --root
	cgroup  string
	cmd     *exec.Cmd
	stream  *pipeStream
	exited  chan struct{} // closed when the runsc run/restore process exits
	waitErr error         // how it exited; read after exited is closed

	cleanup boxkit.Cleanup // what destroy undoes, last first
	once    sync.Once
	err     error
	logTail string // runsc's stderr, kept when the directory goes

	egress *egress.Attachment // nil without network
	netns  string             // the network namespace egress made; "": none
}

// pipeStream is the agent's stdout (read) and stdin (write).
type pipeStream struct {
	r, w *os.File
	once sync.Once
}

func (p *pipeStream) Read(b []byte) (int, error)  { return p.r.Read(b) }
func (p *pipeStream) Write(b []byte) (int, error) { return p.w.Write(b) }
func (p *pipeStream) Close() error {
	var err error
	p.once.Do(func() { err = errors.Join(p.w.Close(), p.r.Close()) })
	return err
}

// runscCmd is runsc with the backend's global flags. All runsc commands of
// one box use the same flags; checkpoint and restore need the same platform.
func (b *Backend) runscCmd(ctx context.Context, state string, args ...string) *exec.Cmd {
	flags := []string{
		"--root=" + state,
		"--platform=" + b.opts.Platform,
		"--network=" + b.network(),
		"--overlay2=none",
		"--cpu-num-from-quota",
		"--host-uds=none",
		"--oci-seccomp", // the box's syscall policy (Seccomp)
	}
	if b.sharedRoot != "" {
		// One empty network namespace for the gofers of all this
		// backend's boxes instead of one per box (runsc keeps it under
		// the shared root, which goes with the backend's directory).
		flags = append(flags, "--shared-root="+b.sharedRoot)
	}
	if b.opts.Debug {
		flags = append(flags, "--debug", "--debug-log="+filepath.Join(filepath.Dir(state), "logs")+"/")
	}
	cmd := exec.CommandContext(ctx, b.runsc, append(flags, args...)...)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.WaitDelay = time.Second
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// start writes the box's bundle and runs (or, with image, restores) it with
// pipes for stdio, wired to the egress gateway as session's box when the
// backend has a policy. The returned stream talks to the agent.
func (b *Backend) start(ctx context.Context, session, cid string, cfg boxConfig, image string) (_ *box, _ *pipeStream, err error) {
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, nil, errors.New("starting gvisor box: backend closed")
	}
	dir := filepath.Join(b.dir, "boxes", cid)
	bx := &box{b: b, cid: cid, dir: dir, state: filepath.Join(dir, "state"), cgroup: cfg.CgroupPath, exited: make(chan struct{})}
	bundle := filepath.Join(dir, "bundle")
	defer func() {
		if err != nil {
			bx.cleanup.Run()
		}
	}()
	// The box's steps, undone in reverse: its directory (with whatever
	// runsc left mounted there), its cgroup, and once runsc runs, runsc.
	bx.cleanup.Add(func() error { return removeState(dir) })
	bx.cleanup.Add(func() error { return b.killCgroup(bx.cgroup) })
	for _, d := range []string{bundle, bx.state} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, nil, fmt.Errorf("creating box directory: %w", err)
		}
	}
	if cfg.Net, err = b.attachEgress(ctx, bx, session); err != nil {
		return nil, nil, err
	}
	js, err := json.MarshalIndent(buildSpec(cfg), "", "  ")
	if err != nil {
		return nil, nil, fmt.Errorf("encoding OCI spec: %w", err)
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), js, 0o600); err != nil {
		return nil, nil, fmt.Errorf("writing OCI spec: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(dir, "runsc.log"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("creating runsc log: %w", err)
	}
	defer logf.Close()
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, nil, fmt.Errorf("creating stdin pipe: %w", err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, nil, fmt.Errorf("creating stdout pipe: %w", err)
	}
	var cmd *exec.Cmd
	// The box outlives ctx: ctx bounds only the wait for its hello.
	if image == "" {
		cmd = b.runscCmd(context.Background(), bx.state, "run", "--bundle="+bundle, cid)
	} else {
		cmd = b.runscCmd(context.Background(), bx.state, "restore", "--image-path="+image, "--bundle="+bundle, cid)
	}
	cmd.Dir = dir
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, logf
	// Its own process group, so that a signal to kiln's group (^C) does not
	// reach runsc, which would forward it into the box. The box dies with
	// kiln: runsc gets SIGKILL when kiln dies (Pdeathsig, which the Go
	// runtime ties to the thread that starts it; kiln's threads end only
	// with a goroutine that locked one, and none of those starts runsc),
	// and runsc run and restore, attached to their sandbox, start the
	// sandbox and its gofer with Pdeathsig of their own. A wedged box
	// that never sees its stream close dies all the same.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return nil, nil, fmt.Errorf("starting runsc: %w", err)
	}
	bx.cmd = cmd
	bx.stream = &pipeStream{r: outR, w: inW}
	bx.cleanup.Add(bx.stop)
	bx.cleanup.Add(bx.keepLog)
	go func() {
		bx.waitErr = cmd.Wait()
		close(bx.exited)
	}()
	b.mu.Lock()
	b.boxes[cid] = bx
	b.mu.Unlock()
	return bx, bx.stream, nil
}

func (bx *box) closeStream() { bx.stream.Close() }

// selfExit reports whether runsc run/restore, which has exited, ended
// cleanly by itself: the box's agent exited with status 0, so runsc
// delete has nothing to do that the box's cleanup does not.
func (bx *box) selfExit() bool { return bx.waitErr == nil }

// explain adds what runsc said to an error about the box.
func (bx *box) explain(err error) error {
	bx.once.Do(func() {}) // nothing to do if not destroyed yet; read the log below
	msg := bx.logTail
	if msg == "" {
		if b, rerr := os.ReadFile(filepath.Join(bx.dir, "runsc.log")); rerr == nil {
			msg = tail(string(b), 1500)
		}
	}
	if msg == "" {
		return err
	}
	return fmt.Errorf("%w; runsc: %s", err, msg)
}

// destroy tears the box down: runsc kill, then SIGKILL to runsc, then
// runsc delete -force, then whatever is still left (processes in the box's
// cgroup, mounts under its directory, the directory). It runs once; later
// calls return the first result.
func (bx *box) destroy() error {
	bx.once.Do(func() {
		bx.err = bx.teardown()
		bx.b.mu.Lock()
		delete(bx.b.boxes, bx.cid)
		bx.b.mu.Unlock()
	})
	return bx.err
}

func (bx *box) teardown() error {
	if err := bx.cleanup.Run(); err != nil {
		bx.b.log.Warn("box left something behind", "container", bx.cid, "err", err)
		return fmt.Errorf("destroying gvisor box %s: %w", bx.cid, err)
	}
	return nil
}

// keepLog keeps the tail of runsc's log for explain, before the box's
// directory goes.
func (bx *box) keepLog() error {
	if b, err := os.ReadFile(filepath.Join(bx.dir, "runsc.log")); err == nil {
		bx.logTail = tail(string(b), 1500)
	}
	return nil
}

// stop ends the box. Its stream is closed by then, and the agent exits at
// the end of its input, ending the sandbox and runsc run/restore with it:
// that costs no other runsc process (each costs about 15 ms of CPU, a
// tenth of a per-call box), and what runsc leaves (state files, its
// cgroups, its network namespace's mount) goes with the box's directory
// and cgroup. A box that does not end by itself within exitGrace gets
// runsc kill, then SIGKILL to runsc, then runsc delete -force; whatever
// survives goes with the box's cgroup.
func (bx *box) stop() error {
	b := bx.b
	select {
	case <-bx.exited:
		if bx.selfExit() {
			return nil
		}
	case <-time.After(exitGrace):
		ctx, cancel := context.WithTimeout(context.Background(), killGrace)
		b.runscCmd(ctx, bx.state, "kill", "--all", bx.cid, "KILL").Run()
		cancel()
		select {
		case <-bx.exited:
		case <-time.After(killGrace):
			bx.cmd.Process.Kill()
			<-bx.exited
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), deleteGrace)
	out, derr := b.runscCmd(ctx, bx.state, "delete", "--force", bx.cid).CombinedOutput()
	cancel()
	if derr != nil && !strings.Contains(string(out), "does not exist") {
		b.log.Debug("runsc delete", "container", bx.cid, "err", derr, "out", tail(string(out), 500))
	}
	return nil
}

// removeState unmounts whatever is mounted under dir (runsc leaves a bind
// of the sandbox's network namespace under its root) and removes dir.
func removeState(dir string) error {
	mounts, err := boxkit.MountsUnder(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, m := range mounts {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmounting %s: %w", m, err))
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		errs = append(errs, fmt.Errorf("removing state directory: %w", err))
	}
	return errors.Join(errs...)
}

// prepareState creates this process's state directory and destroys what
// kiln processes that have died left in the state directory.
func (b *Backend) prepareState() error {
	base := b.opts.StateDir
	if base == "" {
		base = "/run/kiln-gvisor"
		if err := os.MkdirAll(base, 0o700); err != nil {
			base = filepath.Join(os.TempDir(), "kiln-gvisor")
		}
	}
	if err := os.MkdirAll(base, 0o700); err != nil {
		return fmt.Errorf("creating gvisor state directory: %w", err)
	}
	b.sweep(base)
	b.sweepCgroups()
	// One directory per backend, "<owner>-<random>": a process may hold
	// several.
	b.dir = filepath.Join(base, b.owner+"-"+randSuffix())
	if err := os.MkdirAll(b.dir, 0o700); err != nil {
		return fmt.Errorf("creating gvisor state directory: %w", err)
	}
	shared := filepath.Join(b.dir, "shared")
	if err := os.MkdirAll(shared, 0o700); err != nil {
		return fmt.Errorf("creating gvisor state directory: %w", err)
	}
	b.sharedRoot = shared
	return nil
}

// sweep destroys the boxes of kiln processes that are gone.
func (b *Backend) sweep(base string) {
	boxkit.SweepOrphans(base, "", func(dir string) error {
		b.log.Info("destroying boxes left by a dead kiln process", "dir", dir)
		b.sweepDir(dir)
		return nil
	})
}

func (b *Backend) sweepDir(dir string) {
	boxes, _ := filepath.Glob(filepath.Join(dir, "boxes", "*"))
	for _, bd := range boxes {
		cid := filepath.Base(bd)
		ctx, cancel := context.WithTimeout(context.Background(), deleteGrace)
		b.runscCmd(ctx, filepath.Join(bd, "state"), "delete", "--force", cid).Run()
		cancel()
		b.killCgroup(boxCgroup(bd))
	}
	if err := removeState(dir); err != nil {
		b.log.Warn("sweeping gvisor state", "dir", dir, "err", err)
	}
}

// boxCgroup is the cgroup of the box whose directory is dir, as its OCI
// spec names it.
func boxCgroup(dir string) string {
	var s struct {
		Linux struct {
			CgroupsPath string `json:"cgroupsPath"`
		} `json:"linux"`
	}
	js, err := os.ReadFile(filepath.Join(dir, "bundle", "config.json"))
	if err == nil && json.Unmarshal(js, &s) == nil && strings.HasPrefix(s.Linux.CgroupsPath, CgroupParent+"/") {
		return s.Linux.CgroupsPath
	}
	return CgroupParent + "/" + filepath.Base(dir)
}

// killCgroup kills every process left in the box's cgroup rel (runsc made
// it from the OCI spec, in every hierarchy) and removes it.
func (b *Backend) killCgroup(rel string) error {
	if rel == "" {
		return nil
	}
	return b.cgroups.Group(rel).Destroy()
}

// sweepCgroups removes the box cgroups of kiln processes that are gone,
// whichever state directory they used (a test's temporary one, say), and
// kills what is still in them. A cgroup without an owner in its name is an
// older kiln's: it is removed only if empty.
func (b *Backend) sweepCgroups() {
	for _, name := range b.cgroups.Children(CgroupParent) {
		if _, _, owned := boxkit.ParseOwner(name); !owned {
			if g := b.cgroups.Group(CgroupParent + "/" + name); g.RemoveIfEmpty() {
				b.log.Info("removed an empty box cgroup left by a dead kiln process", "cgroup", g.Path())
			}
		}
	}
	removed, err := b.cgroups.Sweep(CgroupParent, func(name string) bool {
		o, _, owned := boxkit.ParseOwner(name)
		return owned && !o.Alive()
	})
	for _, name := range removed {
		b.log.Info("removed a box cgroup left by a dead kiln process", "cgroup", CgroupParent+"/"+name)
	}
	if err != nil {
		b.log.Warn("sweeping gvisor cgroups", "err", err)
	}
}

// presentHostDirs are the boxpolicy.RuntimeDirs that exist as directories (not
// symlinks) on this host.
func presentHostDirs() []hostDir {
	var out []hostDir
	for _, d := range boxpolicy.RuntimeDirs {
		if fi, err := os.Lstat(d); err == nil && fi.IsDir() {
			out = append(out, hostDir{Path: d})
		}
	}
	return out
}

// buildHostRoot synthesizes the root of host-runtime boxes at dir: mount
// points for the host runtime, the symlinks of a usrmerged host, an /etc of
// its own, and the mount points of the workspace, /tmp and the agent.
func buildHostRoot(dir string, uid, gid uint32) error {
	mk := func(p string, mode fs.FileMode) error { return os.MkdirAll(filepath.Join(dir, p), mode) }
	for _, d := range []string{"proc", "dev", "sys", "work", "tmp", "etc", ".kiln", "root", "home", "var", "run", "opt", "mnt"} {
		if err := mk(d, 0o755); err != nil {
			return fmt.Errorf("building box root: %w", err)
		}
	}
	for _, d := range boxpolicy.RuntimeDirs {
		fi, err := os.Lstat(d)
		switch {
		case err != nil:
			continue
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(d)
			if err != nil {
				return fmt.Errorf("building box root: %w", err)
			}
			if err := os.Symlink(target, filepath.Join(dir, d)); err != nil {
				return fmt.Errorf("building box root: %w", err)
			}
		case fi.IsDir():
			if err := mk(d, 0o755); err != nil {
				return fmt.Errorf("building box root: %w", err)
			}
		}
	}
	if err := os.WriteFile(filepath.Join(dir, boxpolicy.AgentPath), nil, 0o755); err != nil {
		return fmt.Errorf("building box root: %w", err)
	}
	etc := filepath.Join(dir, "etc")
	for _, name := range boxpolicy.EtcFromHost {
		if err := copyTree(filepath.Join("/etc", name), filepath.Join(etc, name)); err != nil {
			return fmt.Errorf("copying /etc/%s into box root: %w", name, err)
		}
	}
	for name, content := range boxpolicy.Etc(boxpolicy.Hostname, "", int(uid), int(gid)) {
		if err := os.WriteFile(filepath.Join(etc, name), []byte(content), 0o644); err != nil {
			return fmt.Errorf("building box /etc: %w", err)
		}
	}
	// The root is served read-only; make it so on the host too.
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.Type()&fs.ModeSymlink != 0 {
			return err
		}
		if d.IsDir() {
			return os.Chmod(p, 0o755)
		}
		return nil
	})
}

// copyTree copies src to dst: directories, regular files and symlinks (as
// links); anything else is skipped. A missing src is not an error.
func copyTree(src, dst string) error {
	fi, err := os.Lstat(src)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		target, err := os.Readlink(src)
		if err != nil {
			return err
		}
		return os.Symlink(target, dst)
	case fi.IsDir():
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
		entries, err := os.ReadDir(src)
		if err != nil {
			return err
		}
		for _, e := range entries {
			if err := copyTree(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())); err != nil {
				return err
			}
		}
		return nil
	case fi.Mode().IsRegular():
		if fi.Mode().Perm()&0o004 == 0 {
			return nil // not world-readable on the host: not for the box
		}
		b, err := os.ReadFile(src)
		if err != nil {
			return err
		}
		return os.WriteFile(dst, b, 0o644)
	}
	return nil
}
