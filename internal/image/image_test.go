package image

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestParseDeb822(t *testing.T) {
	src := `Types: deb
# a comment
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
`
	suite, mirror := parseDeb822(src)
	if suite != "bookworm" || mirror != "http://mirror.example/debian" {
		t.Errorf("parseDeb822 = %q, %q", suite, mirror)
	}
	if s, m := parseDeb822("Types: deb-src\nURIs: x\nSuites: y\n"); s != "" || m != "" {
		t.Errorf("deb-src only: got %q, %q", s, m)
	}
}

func TestParseSourcesList(t *testing.T) {
	for _, tc := range []struct{ in, suite, mirror string }{
		{"deb http://m.example/debian trixie main", "trixie", "http://m.example/debian"},
		{"deb [arch=amd64 signed-by=/k.gpg] http://m.example/debian bookworm main", "bookworm", "http://m.example/debian"},
		{"# deb http://x y main\ndeb http://s.example/ bookworm-security main\ndeb http://m.example/ sid main", "sid", "http://m.example/"},
		{"", "", ""},
	} {
		s, m := parseSourcesList(tc.in)
		if s != tc.suite || m != tc.mirror {
			t.Errorf("parseSourcesList(%q) = %q, %q; want %q, %q", tc.in, s, m, tc.suite, tc.mirror)
		}
	}
}

func TestOrderModules(t *testing.T) {
	deps := map[string][]string{
		"virtio_mmio": {"virtio", "virtio_ring"},
		"virtio_blk":  {"virtio", "virtio_ring"},
		"virtio_ring": {"virtio"},
		"ext4":        {"jbd2", "mbcache", "crc16"},
		"jbd2":        {},
		"a":           {"b"},
		"b":           {"a"},
	}
	get := func(n string) ([]string, error) {
		d, ok := deps[n]
		if !ok {
			return nil, nil
		}
		return d, nil
	}
	got, err := orderModules([]string{"virtio-mmio", "virtio_blk", "ext4"}, map[string]bool{"mbcache": true}, get)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"virtio", "virtio_ring", "virtio_mmio", "virtio_blk", "jbd2", "crc16", "ext4"}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("order (-want +got):\n%s", d)
	}
	if _, err := orderModules([]string{"a"}, nil, get); err == nil {
		t.Error("cycle not detected")
	}
}

// TestCpio parses what cpioWriter writes.
func TestCpio(t *testing.T) {
	var buf bytes.Buffer
	c := newCpio(&buf)
	c.Dir("dev", 0o755)
	c.CharDev("dev/console", 0o600, 5, 1)
	c.File("/init", 0o755, []byte("hello"))
	c.File("etc/kiln/modules", 0o644, []byte("/lib/modules/a.ko\n"))
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	type entry struct {
		Name     string
		Mode     uint64
		Data     string
		Maj, Min uint64
	}
	var got []entry
	b := buf.Bytes()
	for len(b) > 0 {
		if len(b) < 110 || string(b[:6]) != "070701" {
			t.Fatalf("bad header at %d", buf.Len()-len(b))
		}
		field := func(i int) uint64 {
			v, err := strconv.ParseUint(string(b[6+8*i:14+8*i]), 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		mode, size, maj, min, nsize := field(1), field(6), field(9), field(10), field(11)
		off := 110
		name := string(b[off : off+int(nsize)-1])
		off = (off + int(nsize) + 3) &^ 3
		data := string(b[off : off+int(size)])
		off = (off + int(size) + 3) &^ 3
		b = b[off:]
		if name == "TRAILER!!!" {
			if len(b) != 0 {
				t.Errorf("%d bytes after trailer", len(b))
			}
			break
		}
		got = append(got, entry{name, mode, data, maj, min})
	}
	want := []entry{
		{"dev", cpioDir | 0o755, "", 0, 0},
		{"dev/console", cpioChr | 0o600, "", 5, 1},
		{"init", cpioReg | 0o755, "hello", 0, 0},
		{"etc/kiln/modules", cpioReg | 0o644, "/lib/modules/a.ko\n", 0, 0},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("archive (-want +got):\n%s", d)
	}
}

func TestKeys(t *testing.T) {
	a := Options{Suite: "bookworm", Mirror: "m", Packages: []string{"b", "a"}, KernelPackage: "k", Modules: []string{"x"}}
	b := a
	b.Packages = []string{"a", "b"}
	if a.baseKey() != b.baseKey() {
		t.Error("package order changed the key")
	}
	for i, mut := range []func(*Options){
		func(o *Options) { o.Suite = "trixie" },
		func(o *Options) { o.Packages = []string{"a"} },
		func(o *Options) { o.Modules = []string{"y"} },
	} {
		c := a
		mut(&c)
		if c.baseKey() == a.baseKey() {
			t.Errorf("mutation %d kept the key", i)
		}
	}
	_ = fmt.Sprint
}

func TestPrune(t *testing.T) {
	dir := t.TempDir()
	for i := range 5 {
		d := filepath.Join(dir, fmt.Sprintf("image-%d", i))
		os.MkdirAll(d, 0o755)
		m := filepath.Join(d, manifestName)
		os.WriteFile(m, []byte("{}"), 0o644)
		tm := time.Unix(int64(1000+i), 0)
		os.Chtimes(m, tm, tm)
	}
	os.MkdirAll(filepath.Join(dir, "base-x"), 0o755)
	if err := pruneImages(dir, 2); err != nil {
		t.Fatal(err)
	}
	left, _ := filepath.Glob(filepath.Join(dir, "*"))
	want := []string{filepath.Join(dir, "base-x"), filepath.Join(dir, "image-3"), filepath.Join(dir, "image-4")}
	if d := cmp.Diff(want, left); d != "" {
		t.Errorf("left (-want +got):\n%s", d)
	}
}
