package image

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// kernelTools are what the kernel build runs, with the Debian package that
// has each (libelf-dev and libssl-dev are needed too, by objtool and the
// build's host programs; make reports them missing itself).
var kernelTools = []struct{ cmd, pkg string }{
	{"make", "make"},
	{"gcc", "gcc"},
	{"bc", "bc"},
	{"bison", "bison"},
	{"flex", "flex"},
	{"tar", "tar"},
	{"xz", "xz-utils"},
	{"perl", "perl"},
}

// firecrackerKernel is the manifest of a built kernel.
type firecrackerKernel struct {
	Key     string         `json:"key"`
	Release string         `json:"release"` // make kernelrelease: "6.1.172"
	Source  string         `json:"source"`  // the tarball it was built from
	Config  []KernelOption `json:"config"`
	Took    string         `json:"took"`
}

const kernelConfigName = "config"

// BuildFirecrackerKernel builds an uncompressed kernel (vmlinux) for
// Firecracker from Debian's linux-source package: tinyconfig plus
// opts.Config, everything built in. It returns the path of the vmlinux; its
// .config sits next to it as "config". Kernels are cached under the cache
// dir keyed by the source tarball and the config, so building again with
// the same inputs is a no-op. Only x86-64 hosts are supported.
func BuildFirecrackerKernel(ctx context.Context, opts KernelOptions) (string, error) {
	if runtime.GOARCH != "amd64" {
		return "", fmt.Errorf("building firecracker kernel: the config is for x86-64, not %s", runtime.GOARCH)
	}
	opts, err := opts.withDefaults()
	if err != nil {
		return "", err
	}
	key, err := opts.key()
	if err != nil {
		return "", err
	}
	log := opts.Logger.With("fckernel", key)
	dir := filepath.Join(opts.CacheDir, "fckernel-"+key)
	vmlinux := filepath.Join(dir, vmlinuxName)
	if !opts.Force && kernelBuilt(dir) {
		log.Info("firecracker kernel up to date", "path", vmlinux)
		return vmlinux, nil
	}
	for _, t := range kernelTools {
		if _, err := exec.LookPath(t.cmd); err != nil {
			return "", fmt.Errorf("building firecracker kernel: %s not found (install the Debian package %s)", t.cmd, t.pkg)
		}
	}
	if err := os.MkdirAll(opts.CacheDir, 0o755); err != nil {
		return "", fmt.Errorf("creating cache dir: %w", err)
	}
	unlock, err := lockDir(ctx, opts.CacheDir, log)
	if err != nil {
		return "", err
	}
	defer unlock()
	if !opts.Force && kernelBuilt(dir) { // another build may have finished while we waited
		return vmlinux, nil
	}
	start := time.Now()
	if err := buildKernel(ctx, opts, key, dir, log); err != nil {
		return "", fmt.Errorf("building firecracker kernel: %w", err)
	}
	log.Info("firecracker kernel built", "path", vmlinux, "took", time.Since(start).Round(time.Second))
	return vmlinux, nil
}

func kernelBuilt(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, manifestName))
	return err == nil
}

func (o KernelOptions) withDefaults() (KernelOptions, error) {
	if o.CacheDir == "" {
		d, err := defaultCacheDir()
		if err != nil {
			return o, err
		}
		o.CacheDir = d
	}
	if o.Source == "" {
		srcs, _ := filepath.Glob("/usr/src/linux-source-*.tar.xz")
		if len(srcs) == 0 {
			return o, errors.New("building firecracker kernel: no /usr/src/linux-source-*.tar.xz (install Debian's linux-source package)")
		}
		// The newest version: sort on the version numbers, not the text.
		slices.SortFunc(srcs, func(a, b string) int { return compareVersions(srcVersion(a), srcVersion(b)) })
		o.Source = srcs[len(srcs)-1]
	}
	if len(o.Config) == 0 {
		o.Config = FirecrackerKernelConfig
	}
	if o.Jobs <= 0 {
		o.Jobs = runtime.NumCPU()
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o, nil
}

// srcVersion is "6.1" for /usr/src/linux-source-6.1.tar.xz.
func srcVersion(p string) string {
	return strings.TrimSuffix(strings.TrimPrefix(filepath.Base(p), "linux-source-"), ".tar.xz")
}

// key names the built kernel: the recipe, the source tarball's contents
// (the Debian package's version changes them) and the config list.
func (o KernelOptions) key() (string, error) {
	sum, err := hashFile(o.Source)
	if err != nil {
		return "", fmt.Errorf("reading kernel source: %w", err)
	}
	return hashJSON(struct {
		Recipe int
		Source string
		Config []KernelOption
	}{kernelRecipe, sum, o.Config}), nil
}

// buildKernel unpacks the source next to dir, configures and compiles it,
// and stores vmlinux, its config and the manifest in dir. The source tree
// (about 1.5 GiB once built) is removed afterwards.
func buildKernel(ctx context.Context, opts KernelOptions, key, dir string, log *slog.Logger) error {
	tmp := dir + ".tmp"
	if err := removeTree(tmp); err != nil {
		return fmt.Errorf("clearing %s: %w", tmp, err)
	}
	src := filepath.Join(tmp, "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	ok := false
	defer func() {
		if !ok {
			removeTree(tmp)
		}
	}()
	start := time.Now()
	mk := func(ctx context.Context, args ...string) error {
		return run(ctx, log, "make", append([]string{"-C", src, "ARCH=x86_64"}, args...)...)
	}
	var release string
	steps := []struct {
		name string
		fn   func(context.Context) error
	}{
		{"unpack kernel source", func(ctx context.Context) error {
			return run(ctx, log, "tar", "-xf", opts.Source, "-C", src, "--strip-components=1")
		}},
		{"configure kernel", func(ctx context.Context) error {
			if err := mk(ctx, "tinyconfig"); err != nil {
				return err
			}
			f, err := os.OpenFile(filepath.Join(src, ".config"), os.O_APPEND|os.O_WRONLY, 0)
			if err != nil {
				return err
			}
			_, err = io.WriteString(f, kernelFragment(opts.Config))
			if err := errors.Join(err, f.Close()); err != nil {
				return err
			}
			if err := mk(ctx, "olddefconfig"); err != nil {
				return err
			}
			cfg, err := os.ReadFile(filepath.Join(src, ".config"))
			if err != nil {
				return err
			}
			return CheckKernelConfig(string(cfg), opts.Config)
		}},
		{"compile kernel", func(ctx context.Context) error {
			return mk(ctx, fmt.Sprintf("-j%d", opts.Jobs), "vmlinux")
		}},
		{"store kernel", func(ctx context.Context) error {
			out, err := output(ctx, log, "make", "-s", "-C", src, "ARCH=x86_64", "kernelrelease")
			if err != nil {
				return err
			}
			release = strings.TrimSpace(out)
			if err := copyFile(filepath.Join(src, "vmlinux"), filepath.Join(tmp, vmlinuxName), 0o644); err != nil {
				return err
			}
			if err := copyFile(filepath.Join(src, ".config"), filepath.Join(tmp, kernelConfigName), 0o644); err != nil {
				return err
			}
			return os.RemoveAll(src)
		}},
	}
	for _, s := range steps {
		if err := step(ctx, log, s.name, s.fn); err != nil {
			return err
		}
	}
	m := firecrackerKernel{
		Key: key, Release: release, Source: opts.Source, Config: opts.Config,
		Took: time.Since(start).Round(time.Second).String(),
	}
	if err := storeBuilt(tmp, dir, manifestName, m, "kernel"); err != nil {
		return err
	}
	ok = true
	return nil
}

// compareVersions orders dotted version numbers ("6.10" after "6.9").
func compareVersions(a, b string) int {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) && i < len(bs); i++ {
		x, _ := strconv.Atoi(as[i])
		y, _ := strconv.Atoi(bs[i])
		if x != y {
			return x - y
		}
	}
	return len(as) - len(bs)
}
