package gvisor

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

var randReader = rand.Reader

// cgroupParent holds the cgroups runsc creates for kiln's boxes, one per box.
const cgroupParent = "/kiln-gvisor"

// Teardown timeouts: each step gets this long before the next, harsher one.
const (
	killGrace   = 3 * time.Second
	deleteGrace = 10 * time.Second
)

// box is one runsc container (its own sandbox) and what it holds on the host.
type box struct {
	b      *Backend
	cid    string
	dir    string // everything of the box on the host: bundle, runsc root, logs
	state  string // runsc --root
	cgroup string
	cmd    *exec.Cmd
	stream *pipeStream
	exited chan struct{} // closed when the runsc run/restore process exits

	once    sync.Once
	err     error
	logTail string // runsc's stderr, kept when the directory goes
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
		"--network=none",
		"--overlay2=none",
		"--cpu-num-from-quota",
		"--host-uds=none",
		"--oci-seccomp", // the box's syscall policy (seccompSpec)
	}
	if b.opts.Debug {
		flags = append(flags, "--debug", "--debug-log="+filepath.Join(filepath.Dir(state), "logs")+"/")
	}
	cmd := exec.CommandContext(ctx, b.runsc, append(flags, args...)...)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.WaitDelay = time.Second
	return cmd
}

// start writes the box's bundle and runs (or, with image, restores) it with
// pipes for stdio. The returned stream talks to the agent.
func (b *Backend) start(ctx context.Context, cid string, cfg boxConfig, image string) (*box, *pipeStream, error) {
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, nil, errors.New("starting gvisor box: backend closed")
	}
	dir := filepath.Join(b.dir, "boxes", cid)
	bx := &box{b: b, cid: cid, dir: dir, state: filepath.Join(dir, "state"), cgroup: cfg.CgroupPath, exited: make(chan struct{})}
	bundle := filepath.Join(dir, "bundle")
	for _, d := range []string{bundle, bx.state} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, nil, fmt.Errorf("creating box directory: %w", err)
		}
	}
	fail := func(err error) (*box, *pipeStream, error) {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	js, err := json.MarshalIndent(buildSpec(cfg), "", "  ")
	if err != nil {
		return fail(fmt.Errorf("encoding OCI spec: %w", err))
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), js, 0o600); err != nil {
		return fail(fmt.Errorf("writing OCI spec: %w", err))
	}
	logf, err := os.OpenFile(filepath.Join(dir, "runsc.log"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return fail(fmt.Errorf("creating runsc log: %w", err))
	}
	defer logf.Close()
	inR, inW, err := os.Pipe()
	if err != nil {
		return fail(fmt.Errorf("creating stdin pipe: %w", err))
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return fail(fmt.Errorf("creating stdout pipe: %w", err))
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
	// reach runsc, which would forward it into the box.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = cmd.Start()
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return fail(fmt.Errorf("starting runsc: %w", err))
	}
	bx.cmd = cmd
	bx.stream = &pipeStream{r: outR, w: inW}
	go func() {
		cmd.Wait()
		close(bx.exited)
	}()
	b.mu.Lock()
	b.boxes[cid] = bx
	b.mu.Unlock()
	return bx, bx.stream, nil
}

func (bx *box) closeStream() { bx.stream.Close() }

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
	b := bx.b
	if b, err := os.ReadFile(filepath.Join(bx.dir, "runsc.log")); err == nil {
		bx.logTail = tail(string(b), 1500)
	}
	select {
	case <-bx.exited:
	default:
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
	var errs []error
	if err := killCgroup(bx.cgroup); err != nil {
		errs = append(errs, err)
	}
	if err := removeState(bx.dir); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		b.log.Warn("box left something behind", "container", bx.cid, "err", err)
		return fmt.Errorf("destroying gvisor box %s: %w", bx.cid, err)
	}
	return nil
}

// removeState unmounts whatever is mounted under dir (runsc leaves a bind
// of the sandbox's network namespace under its root) and removes dir.
func removeState(dir string) error {
	mounts, err := mountsUnder(dir)
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

// mountsUnder lists the mount points at or under dir, deepest first.
func mountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("reading mounts: %w", err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMountinfo(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, sc.Err()
}

// unescapeMountinfo undoes the octal escapes (\040 for a space) of
// /proc/self/mountinfo.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// cgroupDirs lists the directories of cgroup path rel in every mounted
// hierarchy (v1 controllers and the v2 unified tree).
func cgroupDirs(rel string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	seen := map[string]bool{}
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		_, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		fsType, _, _ := strings.Cut(post, " ")
		if fsType != "cgroup" && fsType != "cgroup2" {
			continue
		}
		fields := strings.Fields(line)
		d := filepath.Join(unescapeMountinfo(fields[4]), rel)
		if !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	return out
}

// killCgroup kills every process left in the box's cgroup and removes it.
func killCgroup(rel string) error {
	if rel == "" {
		return nil
	}
	var errs []error
	for _, d := range cgroupDirs(rel) {
		if _, err := os.Stat(d); err != nil {
			continue
		}
		for attempt := 0; ; attempt++ {
			pids := cgroupProcs(d)
			if len(pids) == 0 {
				break
			}
			if attempt == 50 {
				errs = append(errs, fmt.Errorf("processes %v survive in cgroup %s", pids, d))
				break
			}
			os.WriteFile(filepath.Join(d, "cgroup.kill"), []byte("1"), 0) // v2 only
			for _, pid := range pids {
				syscall.Kill(pid, syscall.SIGKILL)
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err := rmdirRetry(d); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func cgroupProcs(dir string) []int {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

func rmdirRetry(d string) error {
	var err error
	for i := 0; i < 50; i++ {
		err = syscall.Rmdir(d)
		if err == nil || errors.Is(err, syscall.ENOENT) {
			return nil
		}
		if !errors.Is(err, syscall.EBUSY) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("removing cgroup %s: %w", d, err)
}

// removeCgroup removes the cgroup rel in every hierarchy if it is empty.
func removeCgroup(rel string) {
	for _, d := range cgroupDirs(rel) {
		syscall.Rmdir(d)
	}
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
	// One directory per backend: a process may hold several.
	b.dir = filepath.Join(base, strconv.Itoa(os.Getpid())+"-"+randSuffix())
	if err := os.MkdirAll(b.dir, 0o700); err != nil {
		return fmt.Errorf("creating gvisor state directory: %w", err)
	}
	if err := os.WriteFile(filepath.Join(b.dir, "owner"), []byte(processStamp(os.Getpid())), 0o600); err != nil {
		return fmt.Errorf("writing gvisor state owner: %w", err)
	}
	return nil
}

// sweep destroys the boxes of kiln processes that are gone.
func (b *Backend) sweep(base string) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join(base, e.Name())
		owner, err := os.ReadFile(filepath.Join(dir, "owner"))
		if errors.Is(err, fs.ErrNotExist) {
			// Being created right now, or its owner died before writing
			// it: judge by the pid in the name.
			pidStr, _, _ := strings.Cut(e.Name(), "-")
			if pid, err := strconv.Atoi(pidStr); err == nil && processStamp(pid) != "" {
				continue
			}
		} else if err != nil {
			continue
		} else if pidStr, _, _ := strings.Cut(string(owner), " "); pidStr != "" {
			if pid, err := strconv.Atoi(pidStr); err == nil && processStamp(pid) == string(owner) {
				continue // its owner lives
			}
		}
		b.log.Info("destroying boxes left by a dead kiln process", "dir", dir)
		b.sweepDir(dir)
	}
}

func (b *Backend) sweepDir(dir string) {
	boxes, _ := filepath.Glob(filepath.Join(dir, "boxes", "*"))
	for _, bd := range boxes {
		cid := filepath.Base(bd)
		ctx, cancel := context.WithTimeout(context.Background(), deleteGrace)
		b.runscCmd(ctx, filepath.Join(bd, "state"), "delete", "--force", cid).Run()
		cancel()
		killCgroup(cgroupParent + "/" + cid)
	}
	if err := removeState(dir); err != nil {
		b.log.Warn("sweeping gvisor state", "dir", dir, "err", err)
	}
}

// processStamp identifies a live process across pid reuse: its pid and
// start time.
func processStamp(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return ""
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		s = s[i+1:]
	}
	f := strings.Fields(s)
	if len(f) < 20 {
		return ""
	}
	return strconv.Itoa(pid) + " " + f[19] // field 22: starttime
}

// presentHostDirs are the hostRuntimeDirs that exist as directories (not
// symlinks) on this host.
func presentHostDirs() []hostDir {
	var out []hostDir
	for _, d := range hostRuntimeDirs {
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
	for _, d := range hostRuntimeDirs {
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
	if err := os.WriteFile(filepath.Join(dir, agentPath), nil, 0o755); err != nil {
		return fmt.Errorf("building box root: %w", err)
	}
	etc := filepath.Join(dir, "etc")
	for _, name := range hostEtc {
		if err := copyTree(filepath.Join("/etc", name), filepath.Join(etc, name)); err != nil {
			return fmt.Errorf("copying /etc/%s into box root: %w", name, err)
		}
	}
	files := map[string]string{}
	for k, v := range synthEtc {
		files[k] = v
	}
	if uid != 65534 {
		files["passwd"] += fmt.Sprintf("kiln:x:%d:%d:kiln:/work:/usr/sbin/nologin\n", uid, gid)
	}
	if gid != 65534 {
		files["group"] += fmt.Sprintf("kiln:x:%d:\n", gid)
	}
	for name, content := range files {
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
