// Package image builds the microVM guest image from Debian packages: a
// read-only ext4 root filesystem (debootstrap minbase plus Python and its
// scientific libraries, with kiln-agent as init), Debian's kernel and a
// tiny initramfs whose /init is kiln-agent itself (it loads the virtio and
// ext4 modules and switches to the root disk; see package guestinit).
//
// Nothing is loop-mounted: the root filesystem is packed with mkfs.ext4 -d
// and the initramfs is written as a newc cpio archive by this package.
//
// Images are cached under the user's cache directory, keyed by a hash of
// their inputs; building again with the same inputs is a no-op. The slow
// part (debootstrap and apt) is cached separately as a base, so a new agent
// binary only repacks the root filesystem.
package image

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// recipe versions the build steps; bump it when a step changes what it
// produces, so old caches are not reused.
const recipe = 1

// Sentinel errors of the package.
var (
	ErrNoAgent     = errors.New("image: no kiln-agent binary (CGO_ENABLED=0 go build ./cmd/kiln-agent; put it next to kiln or on PATH, or pass its path)")
	ErrUnsupported = errors.New("image: building images is supported on Linux only")
	ErrNotBuilt    = errors.New("image: not built yet (run kiln image build)")
)

// DefaultPackages are installed on top of debootstrap's minbase: the
// host runtime's (the Makefile's APT_RUNTIME), pip included, which a box
// under an egress allowlist installs through the gateway with.
var DefaultPackages = []string{"python3", "python3-numpy", "python3-pandas", "python3-matplotlib", "python3-dill", "python3-pip"}

// DefaultModules are the kernel modules the initramfs loads, by name; their
// dependencies are added and ordered from the modules' own metadata.
// crc32c_generic is asked for by ext4 through the crypto API, which a
// module's "depends" does not list. virtio_net is the NIC of a box with
// an egress policy; a guest without one has no network device, and the
// module then finds nothing to drive.
var DefaultModules = []string{"virtio_mmio", "virtio_blk", "virtio_console", "virtio_rng", "virtio_net", "crc32c_generic", "ext4"}

// prune lists what the build deletes from the root filesystem: nothing in
// it is used at run time by Python, and the root is read-only anyway.
var prune = []string{
	"var/cache/apt/archives", "var/cache/apt/pkgcache.bin", "var/cache/apt/srcpkgcache.bin",
	"var/lib/apt/lists", "var/cache/debconf/templates.dat-old", "var/log",
	"usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
	"usr/share/lintian", "usr/include",
}

// Options select what to build. Zero fields take defaults.
type Options struct {
	// CacheDir holds built images; default os.UserCacheDir()/kiln/images.
	CacheDir string
	// Agent is the path of a static kiln-agent binary (CGO_ENABLED=0);
	// default DefaultAgent().
	Agent string
	// Suite is the Debian release; default the host's (or "bookworm").
	Suite string
	// Mirror is the Debian archive; default the host's first apt source.
	Mirror string
	// Packages are installed on top of minbase; default DefaultPackages.
	Packages []string
	// KernelPackage is the Debian kernel package; default linux-image-amd64.
	KernelPackage string
	// Modules are loaded by the initramfs; default DefaultModules.
	Modules []string
	// Force rebuilds even when a cached image matches.
	Force bool
	// Logger receives progress; nil discards it.
	Logger *slog.Logger
}

// Image is a built guest image: the files a microVM boots from.
type Image struct {
	Dir           string   `json:"-"`
	Key           string   `json:"key"`
	Kernel        string   `json:"kernel"` // file names, relative to Dir in the manifest
	Initrd        string   `json:"initrd"`
	Rootfs        string   `json:"rootfs"`
	KernelVersion string   `json:"kernel_version"`
	Python        string   `json:"python"`    // "3.11.2"
	Libraries     []string `json:"libraries"` // "numpy 1.24.2", …
	Suite         string   `json:"suite"`
	Packages      []string `json:"packages"`
}

// KernelPath, InitrdPath and RootfsPath are the absolute paths of the files.
func (im *Image) KernelPath() string { return filepath.Join(im.Dir, im.Kernel) }
func (im *Image) InitrdPath() string { return filepath.Join(im.Dir, im.Initrd) }
func (im *Image) RootfsPath() string { return filepath.Join(im.Dir, im.Rootfs) }

const manifestName = "manifest.json"

// Open reads the image in dir.
func Open(dir string) (*Image, error) {
	b, err := os.ReadFile(filepath.Join(dir, manifestName))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("opening image %s: %w", dir, ErrNotBuilt)
	}
	if err != nil {
		return nil, fmt.Errorf("opening image: %w", err)
	}
	im := new(Image)
	if err := json.Unmarshal(b, im); err != nil {
		return nil, fmt.Errorf("reading image manifest: %w", err)
	}
	im.Dir = dir
	return im, nil
}

// Lookup returns the cached image that Build would produce for opts, or an
// error wrapping ErrNotBuilt. It never builds.
func Lookup(opts Options) (*Image, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	key, err := opts.imageKey()
	if err != nil {
		return nil, err
	}
	return Open(filepath.Join(opts.CacheDir, "image-"+key))
}

// Keep is how many finished images Build keeps in the cache: every new
// agent binary makes a new image, and each is the size of its root
// filesystem. The newest Keep survive; the base they share is kept too.
const Keep = 3

// pruneImages removes all but the newest keep images in cacheDir. A server still
// using a removed image keeps its open files; new VMs need a new image.
func pruneImages(cacheDir string, keep int) error {
	ms, _ := filepath.Glob(filepath.Join(cacheDir, "image-*", manifestName))
	type img struct {
		dir string
		t   int64
	}
	var imgs []img
	for _, m := range ms {
		if fi, err := os.Stat(m); err == nil {
			imgs = append(imgs, img{filepath.Dir(m), fi.ModTime().UnixNano()})
		}
	}
	slices.SortFunc(imgs, func(a, b img) int { return int(b.t - a.t) })
	var errs []error
	for i, im := range imgs {
		if i >= keep {
			errs = append(errs, os.RemoveAll(im.dir))
		}
	}
	return errors.Join(errs...)
}

// Latest returns the most recently built image in the cache, whatever its
// inputs; for servers that were not told which image to use.
func Latest(cacheDir string) (*Image, error) {
	if cacheDir == "" {
		d, err := defaultCacheDir()
		if err != nil {
			return nil, err
		}
		cacheDir = d
	}
	ms, _ := filepath.Glob(filepath.Join(cacheDir, "image-*", manifestName))
	var best string
	var bestTime int64
	for _, m := range ms {
		if fi, err := os.Stat(m); err == nil && fi.ModTime().UnixNano() > bestTime {
			best, bestTime = filepath.Dir(m), fi.ModTime().UnixNano()
		}
	}
	if best == "" {
		return nil, fmt.Errorf("finding an image in %s: %w", cacheDir, ErrNotBuilt)
	}
	return Open(best)
}

func defaultCacheDir() (string, error) {
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("finding cache dir: %w", err)
	}
	return filepath.Join(d, "kiln", "images"), nil
}

func (o Options) withDefaults() (Options, error) {
	if o.CacheDir == "" {
		d, err := defaultCacheDir()
		if err != nil {
			return o, err
		}
		o.CacheDir = d
	}
	if o.Suite == "" || o.Mirror == "" {
		suite, mirror := hostAptSource()
		if o.Suite == "" {
			o.Suite = suite
		}
		if o.Mirror == "" {
			o.Mirror = mirror
		}
	}
	if o.Suite == "" {
		o.Suite = "bookworm"
	}
	if len(o.Packages) == 0 {
		o.Packages = DefaultPackages
	}
	if o.KernelPackage == "" {
		o.KernelPackage = "linux-image-amd64"
	}
	if len(o.Modules) == 0 {
		o.Modules = DefaultModules
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Agent == "" {
		o.Agent = DefaultAgent()
	}
	return o, nil
}

// DefaultAgent is the kiln-agent binary used when Options.Agent is empty:
// the one next to the running executable (make build puts both in bin/),
// else the first on PATH, else "".
func DefaultAgent() string {
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), "kiln-agent")
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			return p
		}
	}
	if p, err := exec.LookPath("kiln-agent"); err == nil {
		return p
	}
	return ""
}

// baseKey names the cached debootstrap tree and kernel: everything but the
// agent.
func (o Options) baseKey() string {
	pk := slices.Clone(o.Packages)
	slices.Sort(pk)
	mods := slices.Clone(o.Modules)
	return hashJSON(struct {
		Recipe              int
		Suite, Mirror, Kern string
		Packages, Modules   []string
	}{recipe, o.Suite, o.Mirror, o.KernelPackage, pk, mods})
}

// imageKey names the finished image: the base plus the agent binary.
func (o Options) imageKey() (string, error) {
	if o.Agent == "" {
		return "", ErrNoAgent
	}
	sum, err := hashFile(o.Agent)
	if err != nil {
		return "", fmt.Errorf("reading agent: %w", err)
	}
	return hashJSON([]string{o.baseKey(), sum}), nil
}

func hashJSON(v any) string {
	b, _ := json.Marshal(v)
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])[:16]
}

// hostAptSource reads the host's first Debian source (deb822 or one-line
// format) so that images come from the same archive the host uses.
func hostAptSource() (suite, mirror string) {
	if b, err := os.ReadFile("/etc/apt/sources.list.d/debian.sources"); err == nil {
		if s, m := parseDeb822(string(b)); m != "" {
			return s, m
		}
	}
	if b, err := os.ReadFile("/etc/apt/sources.list"); err == nil {
		if s, m := parseSourcesList(string(b)); m != "" {
			return s, m
		}
	}
	return "", ""
}

// parseDeb822 returns the suite and URI of the first stanza of type deb
// whose suite has no "-" (not -updates or -security).
func parseDeb822(s string) (suite, mirror string) {
	for _, stanza := range strings.Split(s, "\n\n") {
		fields := map[string]string{}
		for _, line := range strings.Split(stanza, "\n") {
			if strings.HasPrefix(line, "#") {
				continue
			}
			k, v, ok := strings.Cut(line, ":")
			if ok {
				fields[strings.ToLower(strings.TrimSpace(k))] = strings.TrimSpace(v)
			}
		}
		if !slices.Contains(strings.Fields(fields["types"]), "deb") {
			continue
		}
		uris := strings.Fields(fields["uris"])
		for _, su := range strings.Fields(fields["suites"]) {
			if !strings.Contains(su, "-") && len(uris) > 0 {
				return su, uris[0]
			}
		}
	}
	return "", ""
}

// parseSourcesList does the same for the one-line format.
func parseSourcesList(s string) (suite, mirror string) {
	for _, line := range strings.Split(s, "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != "deb" {
			continue
		}
		f = f[1:]
		if strings.HasPrefix(f[0], "[") { // options
			for len(f) > 0 && !strings.HasSuffix(f[0], "]") {
				f = f[1:]
			}
			if len(f) > 0 {
				f = f[1:]
			}
		}
		if len(f) >= 2 && !strings.Contains(f[1], "-") {
			return f[1], f[0]
		}
	}
	return "", ""
}

// hashFile returns the hex sha256 of a file's content (an input of a
// cache key).
func hashFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
