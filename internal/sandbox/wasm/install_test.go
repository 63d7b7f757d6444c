package wasm

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha512"
	"encoding/base64"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func tarball(t *testing.T, entries map[string]string, link bool) (string, string) {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for name, body := range entries {
		tw.WriteHeader(&tar.Header{Name: name, Mode: 0o755, Size: int64(len(body)), Typeflag: tar.TypeReg})
		tw.Write([]byte(body))
	}
	if link {
		tw.WriteHeader(&tar.Header{Name: "package/link", Linkname: "/etc/passwd", Typeflag: tar.TypeSymlink})
	}
	tw.Close()
	zw.Close()
	p := filepath.Join(t.TempDir(), "p.tgz")
	if err := os.WriteFile(p, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	sum := sha512.Sum512(buf.Bytes())
	return p, "sha512-" + base64.StdEncoding.EncodeToString(sum[:])
}

// TestUnpackVerified: a tarball is unpacked only if its sha512 is the
// pinned one, and only regular files and directories under package/.
func TestUnpackVerified(t *testing.T) {
	good, sum := tarball(t, map[string]string{"package/deno": "#!binary", "package/sub/a.txt": "a"}, false)
	dest := filepath.Join(t.TempDir(), "out")
	if err := unpackVerified(good, sum, dest); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dest, "sub/a.txt")); err != nil || string(b) != "a" {
		t.Errorf("unpacked: %q %v", b, err)
	}
	_, other := tarball(t, map[string]string{"package/deno": "#!evil"}, false)
	dest2 := filepath.Join(t.TempDir(), "out")
	if err := unpackVerified(good, other, dest2); err == nil || !strings.Contains(err.Error(), "sha512 mismatch") {
		t.Errorf("a tarball with another hash: %v", err)
	}
	if _, err := os.Stat(dest2); err == nil {
		t.Errorf("a refused tarball left %s", dest2)
	}
	for name, entries := range map[string]map[string]string{
		"climbs out":       {"package/../../evil": "x"},
		"outside package/": {"other/x": "x"},
	} {
		p, s := tarball(t, entries, false)
		if err := unpackVerified(p, s, filepath.Join(t.TempDir(), "out")); err == nil {
			t.Errorf("%s: unpacked", name)
		}
	}
	p, s := tarball(t, map[string]string{"package/a": "a"}, true)
	if err := unpackVerified(p, s, filepath.Join(t.TempDir(), "out")); err == nil {
		t.Errorf("a symlink entry: unpacked")
	}
}

// TestPinned: every pinned tarball has a sha512 integrity.
func TestPinned(t *testing.T) {
	for k, p := range denoPkgs {
		if !strings.HasPrefix(p.integrity, "sha512-") || p.version != DenoVersion {
			t.Errorf("%s: %+v", k, p)
		}
	}
	if !strings.HasPrefix(pyodidePkg.integrity, "sha512-") {
		t.Errorf("pyodide: %+v", pyodidePkg)
	}
}

// TestNotInstalled: without the runtime, the backend names the command
// that installs it (kiln doctor prints this).
func TestNotInstalled(t *testing.T) {
	_, err := New(Options{Dir: t.TempDir()})
	if !errors.Is(err, ErrNotInstalled) || !strings.Contains(err.Error(), "kiln wasm install") {
		t.Errorf("New without a runtime: %v", err)
	}
}
