package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestResolveLinks checks the symlink resolution that runs before os.Root's
// walk (see open): on a Linux kernel os.Root would refuse the escapes by
// itself, so this checks resolveLinks directly, not through os.Root.
func TestResolveLinks(t *testing.T) {
	ws := t.TempDir()
	for _, d := range []string{"a/b", "dir"} {
		if err := os.MkdirAll(filepath.Join(ws, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(ws, "a/b/c.txt"), []byte("c"), 0o644)
	links := map[string]string{
		"rootlink": "/",
		"dir/up":   "../../..",
		"inner":    "a/b",
		"sibling":  "../a",
		"dir/back": "../inner",
		"loop1":    "loop2",
		"loop2":    "loop1",
		"chain":    "rootlink/etc",
	}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(ws, name)); err != nil {
			t.Fatal(err)
		}
	}
	root, err := os.OpenRoot(ws)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	for _, tc := range []struct {
		path, want string // want "" = refused
	}{
		{"a/b/c.txt", "a/b/c.txt"},
		{"inner/c.txt", "a/b/c.txt"},
		{"dir/back/c.txt", "a/b/c.txt"},
		{"a/missing/new.txt", "a/missing/new.txt"},
		{"inner/new/deeper.txt", "a/b/new/deeper.txt"},
		{"a/b/c.txt/x", "a/b/c.txt/x"}, // os.Root reports ENOTDIR
		{"rootlink/etc/passwd", ""},
		{"dir/up/etc/passwd", ""},
		{"sibling/b", ""},
		{"chain/passwd", ""},
		{"loop1/x", ""},
	} {
		parts, err := resolveLinks(root, strings.Split(tc.path, "/"))
		got := strings.Join(parts, "/")
		switch {
		case tc.want == "" && err == nil:
			t.Errorf("resolveLinks(%q) = %q, want refused", tc.path, got)
		case tc.want != "" && err != nil:
			t.Errorf("resolveLinks(%q): %v", tc.path, err)
		case tc.want != "":
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("resolveLinks(%q) (-want +got):\n%s", tc.path, diff)
			}
		}
		if err != nil && !errors.Is(pathErr(tc.path, err), ErrOutsideWorkspace) {
			t.Errorf("resolveLinks(%q): %v is not reported as outside the workspace", tc.path, err)
		}
	}
}
