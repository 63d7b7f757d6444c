package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// BuildFieldHost builds the field host for opts, or returns the cached
// one (keyed by a hash of its inputs). It needs root and the tools of
// Build.
func BuildFieldHost(ctx context.Context, opts FieldHostOptions) (*FieldHost, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	key := opts.key()
	log := opts.Logger.With("fieldhost", key)
	dir := filepath.Join(opts.CacheDir, "fieldhost-"+key)
	if fh, err := openFieldHost(dir); err == nil {
		log.Info("field host up to date", "dir", dir)
		return fh, nil
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("building field host: needs root (debootstrap and chroot)")
	}
	if err := os.MkdirAll(opts.CacheDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating cache dir: %w", err)
	}
	unlock, err := lockDir(ctx, opts.CacheDir, log)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if fh, err := openFieldHost(dir); err == nil {
		return fh, nil
	}
	start := time.Now()
	tmp := dir + ".tmp"
	if err := removeTree(tmp); err != nil {
		return nil, fmt.Errorf("clearing %s: %w", tmp, err)
	}
	root := filepath.Join(tmp, "rootfs")
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return nil, err
	}
	defer removeTree(tmp)
	fh := &FieldHost{Key: key, Kernel: "vmlinuz", Initrd: "initrd.img", Rootfs: "rootfs.ext4",
		Cmdline: FieldHostCmdline, Suite: opts.Suite, Packages: opts.Packages}
	base, err := fieldHostBase(ctx, log, opts)
	if err != nil {
		return nil, fmt.Errorf("building field host: %w", err)
	}
	// A copy of the cached base, configured: the base stays as it is for
	// the next change of configuration.
	if err := run(ctx, log, "cp", "-a", "--reflink=auto", base, root); err != nil {
		return nil, fmt.Errorf("copying the field host base: %w", err)
	}
	steps := []struct {
		name string
		fn   func(context.Context) error
	}{
		{"configure", func(ctx context.Context) error { return configureFieldHost(ctx, log, root) }},
		{"take kernel", func(ctx context.Context) error { return takeFieldHostKernel(root, tmp, fh) }},
		{"prune rootfs", func(ctx context.Context) error {
			for _, p := range []string{"var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale"} {
				if err := os.RemoveAll(filepath.Join(root, p)); err != nil {
					return err
				}
			}
			return nil
		}},
		{"pack rootfs", func(ctx context.Context) error {
			// Room for the suites' boxes, state and logs: the guest
			// writes to its root (into QEMU's snapshot).
			return mkfsExt4(ctx, log, root, filepath.Join(tmp, fh.Rootfs), "fieldhost-root", 2<<30, true)
		}},
	}
	for _, s := range steps {
		if err := step(ctx, log, s.name, s.fn); err != nil {
			return nil, fmt.Errorf("building field host: %w", err)
		}
	}
	if err := os.RemoveAll(root); err != nil {
		return nil, err
	}
	if err := storeBuilt(tmp, dir, manifestName, fh, "field host"); err != nil {
		return nil, err
	}
	fh.Dir = dir
	log.Info("field host built", "dir", dir, "took", time.Since(start).Round(time.Millisecond))
	return fh, nil
}

// fieldHostBase returns the cached Debian tree of the field host
// (debootstrap, packages, the user), building it if needed: the slow part,
// keyed by the suite, mirror and packages only.
func fieldHostBase(ctx context.Context, log *slog.Logger, opts FieldHostOptions) (string, error) {
	dir := filepath.Join(opts.CacheDir, "base-"+opts.baseKey())
	root := filepath.Join(dir, "rootfs")
	if _, err := os.Stat(filepath.Join(dir, "done")); err == nil {
		log.Info("field host base up to date", "dir", dir)
		return root, nil
	}
	tmp := dir + ".tmp"
	if err := removeTree(tmp); err != nil {
		return "", fmt.Errorf("clearing %s: %w", tmp, err)
	}
	troot := filepath.Join(tmp, "rootfs")
	if err := os.MkdirAll(troot, 0o755); err != nil {
		return "", err
	}
	defer removeTree(tmp)
	steps := []struct {
		name string
		fn   func(context.Context) error
	}{
		{"debootstrap", func(ctx context.Context) error {
			args := []string{"--variant=minbase", "--components=main", opts.Suite, troot}
			if opts.Mirror != "" {
				args = append(args, opts.Mirror)
			}
			return run(ctx, log, "debootstrap", args...)
		}},
		{"install packages", func(ctx context.Context) error {
			return inChroot(ctx, log, troot, append([]string{"apt-get", "install", "-y", "--no-install-recommends"}, opts.Packages...)...)
		}},
		{"add user", func(ctx context.Context) error {
			return inChroot(ctx, log, troot, "useradd", "--create-home", "--shell", "/bin/bash",
				"--uid", strconv.Itoa(FieldHostUID), "--user-group", FieldHostUser)
		}},
	}
	for _, s := range steps {
		if err := step(ctx, log, s.name, s.fn); err != nil {
			return "", err
		}
	}
	if err := os.WriteFile(filepath.Join(tmp, "done"), nil, 0o644); err != nil {
		return "", err
	}
	if err := os.RemoveAll(dir); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return "", fmt.Errorf("storing the field host base: %w", err)
	}
	return root, nil
}

func openFieldHost(dir string) (*FieldHost, error) {
	b, err := os.ReadFile(filepath.Join(dir, manifestName))
	if err != nil {
		return nil, err
	}
	fh := new(FieldHost)
	if err := json.Unmarshal(b, fh); err != nil {
		return nil, fmt.Errorf("reading field host manifest: %w", err)
	}
	fh.Dir = dir
	return fh, nil
}

// configureFieldHost writes fieldHostFiles ("link:" makes a symlink) and a
// machine id, and leaves the user's password locked: nobody logs in, the
// suites run from a unit.
func configureFieldHost(ctx context.Context, log *slog.Logger, root string) error {
	for rel, content := range fieldHostFiles {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		os.Remove(p)
		if target, ok := strings.CutPrefix(content, "link:"); ok {
			if err := os.Symlink(target, p); err != nil {
				return err
			}
			continue
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return err
		}
	}
	os.Remove(filepath.Join(root, "etc", "machine-id"))
	return inChroot(ctx, log, root, "systemd-machine-id-setup")
}

// takeFieldHostKernel moves Debian's kernel and the initramfs its package
// made out of /boot.
func takeFieldHostKernel(root, dir string, fh *FieldHost) error {
	vmlinuz, _ := filepath.Glob(filepath.Join(root, "boot", "vmlinuz-*"))
	initrd, _ := filepath.Glob(filepath.Join(root, "boot", "initrd.img-*"))
	if len(vmlinuz) != 1 || len(initrd) != 1 {
		return fmt.Errorf("finding the kernel in /boot: %d kernels, %d initramfs images", len(vmlinuz), len(initrd))
	}
	fh.KernelVersion = strings.TrimPrefix(filepath.Base(vmlinuz[0]), "vmlinuz-")
	if err := copyFile(vmlinuz[0], filepath.Join(dir, fh.Kernel), 0o644); err != nil {
		return err
	}
	return copyFile(initrd[0], filepath.Join(dir, fh.Initrd), 0o644)
}
