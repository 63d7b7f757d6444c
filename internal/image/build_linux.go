package image

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
	"kiln/internal/guestinit"
)

// tools the build runs, with the Debian package that has each.
var tools = []struct{ cmd, pkg string }{
	{"debootstrap", "debootstrap"},
	{"chroot", "coreutils"},
	{"dpkg-deb", "dpkg"},
	{"mkfs.ext4", "e2fsprogs"},
}

// buildEnv is the environment of every command the build runs.
var buildEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"LC_ALL=C", "LANG=C", "DEBIAN_FRONTEND=noninteractive", "HOME=/root",
}

// base is the cached, agent-independent part of an image.
type base struct {
	Dir           string   `json:"-"`
	KernelVersion string   `json:"kernel_version"`
	Modules       []string `json:"modules"` // file names under kernel/modules, in load order
	Python        string   `json:"python"`
	Libraries     []string `json:"libraries"`
}

func (b *base) rootfs() string { return filepath.Join(b.Dir, "rootfs") }

// Build builds the image for opts, or returns the cached one. It needs root
// (debootstrap and chroot) and the tools in the tools table.
func Build(ctx context.Context, opts Options) (*Image, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	key, err := opts.imageKey()
	if err != nil {
		return nil, err
	}
	log := opts.Logger.With("image", key)
	dir := filepath.Join(opts.CacheDir, "image-"+key)
	if !opts.Force {
		if im, err := Open(dir); err == nil {
			log.Info("image up to date", "dir", dir)
			return im, nil
		}
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("building image: needs root (debootstrap and chroot)")
	}
	for _, t := range tools {
		if _, err := exec.LookPath(t.cmd); err != nil {
			if _, err2 := os.Stat("/usr/sbin/" + t.cmd); err2 != nil {
				return nil, fmt.Errorf("building image: %s not found (install the Debian package %s)", t.cmd, t.pkg)
			}
		}
	}
	if err := os.MkdirAll(opts.CacheDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating cache dir: %w", err)
	}
	unlock, err := lockDir(ctx, opts.CacheDir, log)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if !opts.Force { // another build may have finished while we waited
		if im, err := Open(dir); err == nil {
			return im, nil
		}
	}
	start := time.Now()
	b, err := buildBase(ctx, opts, log)
	if err != nil {
		return nil, fmt.Errorf("building image base: %w", err)
	}
	im, err := pack(ctx, opts, b, key, dir, log)
	if err != nil {
		return nil, fmt.Errorf("packing image: %w", err)
	}
	log.Info("image built", "dir", dir, "took", time.Since(start).Round(time.Millisecond))
	if err := pruneImages(opts.CacheDir, Keep); err != nil {
		log.Warn("pruning old images", "err", err)
	}
	return im, nil
}

// lockDir takes an exclusive flock on dir/.lock, waiting for other builds.
func lockDir(ctx context.Context, dir string, log *slog.Logger) (func(), error) {
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("locking cache: %w", err)
	}
	for logged := false; ; {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("locking cache: %w", err)
		}
		if !logged {
			log.Info("waiting for another image build")
			logged = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("locking cache: %w", ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// step runs one named build step, logging its start, progress and end.
func step(ctx context.Context, log *slog.Logger, name string, fn func(context.Context) error) error {
	start := time.Now()
	log.Info("image step", "step", name)
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(15 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				log.Info("image step still running", "step", name, "elapsed", time.Since(start).Round(time.Second))
			}
		}
	}()
	err := fn(ctx)
	close(done)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	log.Info("image step done", "step", name, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// run runs a command, logging its output at debug level and returning the
// tail of it with the error.
func run(ctx context.Context, log *slog.Logger, name string, args ...string) error {
	_, err := output(ctx, log, name, args...)
	return err
}

func output(ctx context.Context, log *slog.Logger, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = buildEnv
	cmd.WaitDelay = 10 * time.Second
	var stdout bytes.Buffer
	pr, pw := io.Pipe()
	cmd.Stdout = io.MultiWriter(&stdout, pw)
	cmd.Stderr = pw
	tail := newTail(30)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			log.Debug(name, "out", sc.Text())
			tail.add(sc.Text())
		}
		io.Copy(io.Discard, pr)
	}()
	err := cmd.Run()
	pw.Close()
	wg.Wait()
	if err != nil {
		return "", fmt.Errorf("running %s: %w\n%s", name, err, tail)
	}
	return stdout.String(), nil
}

type tail struct {
	n     int
	lines []string
}

func newTail(n int) *tail { return &tail{n: n} }

func (t *tail) add(s string) {
	t.lines = append(t.lines, s)
	if len(t.lines) > t.n {
		t.lines = t.lines[1:]
	}
}

func (t *tail) String() string { return strings.Join(t.lines, "\n") }

// buildBase returns the cached base for opts, building it if needed.
func buildBase(ctx context.Context, opts Options, log *slog.Logger) (*base, error) {
	dir := filepath.Join(opts.CacheDir, "base-"+opts.baseKey())
	if b, err := openBase(dir); err == nil && !opts.Force {
		log.Info("image base up to date", "dir", dir)
		return b, nil
	}
	tmp := dir + ".tmp"
	if err := removeTree(tmp); err != nil {
		return nil, fmt.Errorf("clearing %s: %w", tmp, err)
	}
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			removeTree(tmp)
		}
	}()
	b := &base{Dir: tmp}
	root := b.rootfs()
	steps := []struct {
		name string
		fn   func(context.Context) error
	}{
		{"debootstrap", func(ctx context.Context) error {
			return run(ctx, log, "debootstrap", "--variant=minbase", "--components=main",
				opts.Suite, root, opts.Mirror)
		}},
		{"install packages", func(ctx context.Context) error {
			return inChroot(ctx, log, root, append([]string{"apt-get", "install", "-y", "--no-install-recommends"}, opts.Packages...)...)
		}},
		{"fetch kernel", func(ctx context.Context) error { return fetchKernel(ctx, log, opts, b) }},
		{"describe runtime", func(ctx context.Context) error { return describe(ctx, log, opts, b) }},
		{"configure rootfs", func(ctx context.Context) error { return configure(root) }},
		{"prune rootfs", func(ctx context.Context) error {
			for _, p := range prune {
				if err := os.RemoveAll(filepath.Join(root, p)); err != nil {
					return err
				}
			}
			return nil
		}},
	}
	for _, s := range steps {
		if err := step(ctx, log, s.name, s.fn); err != nil {
			return nil, err
		}
	}
	if err := storeBuilt(tmp, dir, "base.json", b, "base"); err != nil {
		return nil, err
	}
	ok = true
	b.Dir = dir
	return b, nil
}

func openBase(dir string) (*base, error) {
	data, err := os.ReadFile(filepath.Join(dir, "base.json"))
	if err != nil {
		return nil, err
	}
	b := new(base)
	if err := json.Unmarshal(data, b); err != nil {
		return nil, err
	}
	b.Dir = dir
	return b, nil
}

// inChroot runs a command in root with /proc mounted (apt and maintainer
// scripts want it); the mount is removed afterwards.
func inChroot(ctx context.Context, log *slog.Logger, root string, args ...string) error {
	_, err := chrootOutput(ctx, log, root, args...)
	return err
}

func chrootOutput(ctx context.Context, log *slog.Logger, root string, args ...string) (string, error) {
	proc := filepath.Join(root, "proc")
	if err := unix.Mount("proc", proc, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return "", fmt.Errorf("mounting proc in chroot: %w", err)
	}
	defer unix.Unmount(proc, unix.MNT_DETACH)
	return output(ctx, log, "chroot", append([]string{root}, args...)...)
}

// fetchKernel downloads the kernel package with the chroot's apt, unpacks
// it outside the root filesystem and keeps vmlinuz and the modules the
// initramfs needs.
func fetchKernel(ctx context.Context, log *slog.Logger, opts Options, b *base) error {
	root := b.rootfs()
	deps, err := chrootOutput(ctx, log, root, "apt-cache", "depends", "--no-recommends", "--no-suggests", opts.KernelPackage)
	if err != nil {
		return err
	}
	pkg := opts.KernelPackage
	for _, line := range strings.Split(deps, "\n") {
		if d, ok := strings.CutPrefix(strings.TrimSpace(line), "Depends: "); ok && strings.HasPrefix(d, "linux-image-") {
			pkg = d
			break
		}
	}
	dl := filepath.Join(root, "tmp", "kernel")
	if err := os.MkdirAll(dl, 0o755); err != nil {
		return err
	}
	defer os.RemoveAll(dl)
	if err := inChroot(ctx, log, root, "sh", "-c", `cd /tmp/kernel && apt-get download "$1"`, "sh", pkg); err != nil {
		return err
	}
	debs, _ := filepath.Glob(filepath.Join(dl, "*.deb"))
	if len(debs) != 1 {
		return fmt.Errorf("downloading %s: found %d packages", pkg, len(debs))
	}
	x := filepath.Join(b.Dir, "kernel-x")
	defer os.RemoveAll(x)
	if err := run(ctx, log, "dpkg-deb", "-x", debs[0], x); err != nil {
		return err
	}
	vmlinuz, _ := filepath.Glob(filepath.Join(x, "boot", "vmlinuz-*"))
	if len(vmlinuz) != 1 {
		return fmt.Errorf("unpacking %s: found %d kernels", pkg, len(vmlinuz))
	}
	b.KernelVersion = strings.TrimPrefix(filepath.Base(vmlinuz[0]), "vmlinuz-")
	kdir := filepath.Join(b.Dir, "kernel")
	if err := os.MkdirAll(filepath.Join(kdir, "modules"), 0o755); err != nil {
		return err
	}
	if err := copyFile(vmlinuz[0], filepath.Join(kdir, "vmlinuz"), 0o644); err != nil {
		return err
	}
	moddir := filepath.Join(x, "lib", "modules", b.KernelVersion)
	idx, err := indexModules(moddir)
	if err != nil {
		return err
	}
	builtin := map[string]bool{}
	if data, err := os.ReadFile(filepath.Join(moddir, "modules.builtin")); err == nil {
		for _, l := range strings.Fields(string(data)) {
			builtin[modName(l)] = true
		}
	}
	order, err := orderModules(opts.Modules, builtin, func(n string) ([]string, error) {
		p, ok := idx[n]
		if !ok {
			return nil, fmt.Errorf("module %s not in %s", n, pkg)
		}
		return moduleDepends(p)
	})
	if err != nil {
		return err
	}
	b.Modules = nil
	for _, n := range order {
		name := n + ".ko"
		if err := copyFile(idx[n], filepath.Join(kdir, "modules", name), 0o644); err != nil {
			return err
		}
		b.Modules = append(b.Modules, name)
	}
	log.Info("kernel", "version", b.KernelVersion, "modules", strings.Join(order, ","))
	return nil
}

// describe records the Python version and library versions for the
// tool descriptions.
func describe(ctx context.Context, log *slog.Logger, opts Options, b *base) error {
	var mods []string
	for _, p := range opts.Packages {
		if m, ok := strings.CutPrefix(p, "python3-"); ok {
			mods = append(mods, m)
		}
	}
	const script = `import sys, platform, importlib.metadata as md
print(platform.python_version())
for m in sys.argv[1:]:
    try:
        print(m, md.version(m))
    except Exception:
        pass
`
	out, err := chrootOutput(ctx, log, b.rootfs(), append([]string{"python3", "-c", script}, mods...)...)
	if err != nil {
		return err
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	b.Python = strings.TrimSpace(lines[0])
	b.Libraries = lines[1:]
	return nil
}

// configure makes the root filesystem a kiln guest: the unprivileged user,
// mount points, and no leftovers from the build host.
func configure(root string) error {
	appendLine := func(rel, line string) error {
		p := filepath.Join(root, rel)
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if bytes.Contains(data, []byte("\n"+strings.SplitN(line, ":", 2)[0]+":")) {
			return nil
		}
		f, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(f, line)
		return errors.Join(err, f.Close())
	}
	for _, e := range []struct{ file, line string }{
		{"etc/passwd", "kiln:x:1000:1000:kiln:/work:/bin/bash"},
		{"etc/group", "kiln:x:1000:"},
		{"etc/shadow", "kiln:!:19000:0:99999:7:::"},
	} {
		if err := appendLine(e.file, e.line); err != nil {
			return fmt.Errorf("adding user: %w", err)
		}
	}
	for _, d := range []string{"work", "tmp", "run", "proc", "sys", "dev", "etc/kiln"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return err
		}
	}
	os.Chmod(filepath.Join(root, "tmp"), 0o1777)
	files := map[string]string{
		"etc/hostname":    "kiln\n",
		"etc/hosts":       "127.0.0.1\tlocalhost kiln\n::1\tlocalhost\n",
		"etc/resolv.conf": "",
		"etc/machine-id":  "",
		// The mount point of a box's egress trust bundle, which the guest
		// binds there when its gateway has secrets (the root is read-only).
		strings.TrimPrefix(boxpolicy.TrustBundle, "/"): "",
	}
	for rel, content := range files {
		p := filepath.Join(root, rel)
		os.Remove(p) // may be a symlink
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// pack writes the finished image: root filesystem with the agent,
// initramfs, kernel and manifest.
func pack(ctx context.Context, opts Options, b *base, key, dir string, log *slog.Logger) (*Image, error) {
	tmp := dir + ".tmp"
	if err := removeTree(tmp); err != nil {
		return nil, fmt.Errorf("clearing %s: %w", tmp, err)
	}
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			removeTree(tmp)
		}
	}()
	im := &Image{
		Key: key, Kernel: "vmlinuz", Initrd: "initrd.img", Rootfs: "rootfs.ext4",
		KernelVersion: b.KernelVersion, Python: b.Python, Libraries: b.Libraries,
		Suite: opts.Suite, Packages: opts.Packages,
	}
	agent, err := os.ReadFile(opts.Agent)
	if err != nil {
		return nil, fmt.Errorf("reading agent: %w", err)
	}
	err = step(ctx, log, "pack rootfs", func(ctx context.Context) error {
		if err := os.WriteFile(filepath.Join(b.rootfs(), guestinit.AgentPath), agent, 0o755); err != nil {
			return fmt.Errorf("installing agent: %w", err)
		}
		// The mount point of a configured template's disk (microvm
		// backend), made here so that cached bases get it too.
		if err := os.MkdirAll(filepath.Join(b.rootfs(), boxpolicy.TemplateDir), 0o755); err != nil {
			return err
		}
		return mkfs(ctx, log, b.rootfs(), filepath.Join(tmp, im.Rootfs))
	})
	if err != nil {
		return nil, err
	}
	err = step(ctx, log, "pack initramfs", func(context.Context) error {
		return writeInitrd(filepath.Join(tmp, im.Initrd), agent, filepath.Join(b.Dir, "kernel", "modules"), b.Modules)
	})
	if err != nil {
		return nil, err
	}
	if err := copyFile(filepath.Join(b.Dir, "kernel", "vmlinuz"), filepath.Join(tmp, im.Kernel), 0o644); err != nil {
		return nil, err
	}
	if err := storeBuilt(tmp, dir, manifestName, im, "image"); err != nil {
		return nil, err
	}
	ok = true
	im.Dir = dir
	return im, nil
}

// mkfs packs root into a read-only-friendly ext4 file (no journal, no
// reserved blocks) sized to fit with some headroom.
func mkfs(ctx context.Context, log *slog.Logger, root, out string) error {
	return mkfsExt4(ctx, log, root, out, "kiln-root", 64<<20, false)
}

// mkfsExt4 packs root into an ext4 file labelled label, sized to fit with
// headroom bytes to spare, with no reserved blocks and a journal if asked.
func mkfsExt4(ctx context.Context, log *slog.Logger, root, out, label string, headroom int64, journal bool) error {
	var size int64
	var files int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		files++
		if fi, err := d.Info(); err == nil && fi.Mode().IsRegular() {
			size += (fi.Size() + 4095) &^ 4095
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("measuring rootfs: %w", err)
	}
	total := (size+files*256)*6/5 + headroom
	total = (total + 1<<20 - 1) &^ (1<<20 - 1)
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	err = f.Truncate(total)
	f.Close()
	if err != nil {
		return err
	}
	inodes := files*3/2 + 4096
	if journal {
		inodes += headroom / 16384
	}
	features := "^has_journal"
	if journal {
		features = "has_journal"
	}
	return run(ctx, log, "mkfs.ext4", "-q", "-F", "-L", label, "-O", features, "-m", "0",
		"-N", fmt.Sprint(inodes), "-d", root, out)
}

// writeInitrd writes the initramfs: kiln-agent as /init, the modules and
// the list of them in load order.
func writeInitrd(out string, agent []byte, moddir string, modules []string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	c := newCpio(bw)
	for _, d := range []string{"dev", "proc", "sys", "newroot", "etc", "etc/kiln", "lib", "lib/modules"} {
		c.Dir(d, 0o755)
	}
	c.CharDev("dev/console", 0o600, 5, 1)
	c.CharDev("dev/null", 0o666, 1, 3)
	c.File("init", 0o755, agent)
	var list strings.Builder
	for _, m := range modules {
		data, err := os.ReadFile(filepath.Join(moddir, m))
		if err != nil {
			f.Close()
			return err
		}
		c.File("lib/modules/"+m, 0o644, data)
		fmt.Fprintf(&list, "/lib/modules/%s\n", m)
	}
	c.File(strings.TrimPrefix(guestinit.ModulesFile, "/"), 0o644, []byte(list.String()))
	err = errors.Join(c.Close(), bw.Flush(), f.Close())
	if err != nil {
		return fmt.Errorf("writing initramfs: %w", err)
	}
	return nil
}

func copyFile(src, dst string, perm os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	return errors.Join(err, out.Close())
}

// storeBuilt is the last step of every cached build: it writes v as the
// manifest (file name) of the finished tree tmp and puts tmp in dir's
// place, so that a reader finds a whole entry or none.
func storeBuilt(tmp, dir, name string, v any, what string) error {
	if err := writeJSON(filepath.Join(tmp, name), v); err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return fmt.Errorf("storing %s: %w", what, err)
	}
	return nil
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
