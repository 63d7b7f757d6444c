package agent

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestWalkFirstIsWalkDir: walkFirst lists the same first entries, in the
// same order, as fs.WalkDir, whatever the limit, in a tree with a large
// directory, nested ones and a symlink to a directory (not followed).
func TestWalkFirstIsWalkDir(t *testing.T) {
	dir := t.TempDir()
	for i := range 700 {
		os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%03d", (i*37)%700)), nil, 0o644)
	}
	for _, d := range []string{"a/b/c", "f350x/y", "zz"} {
		os.MkdirAll(filepath.Join(dir, d), 0o755)
		os.WriteFile(filepath.Join(dir, d, "file"), nil, 0o644)
	}
	os.Symlink("a", filepath.Join(dir, "link"))
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	var all []string
	fs.WalkDir(root.FS(), ".", func(name string, d fs.DirEntry, err error) error {
		if name != "." {
			all = append(all, name)
		}
		return nil
	})
	for _, limit := range []int{0, 1, 5, 351, 352, 353, 400, 710, len(all), len(all) + 10} {
		var got []string
		n := walkFirst(root, ".", limit, func(name string, d fs.DirEntry) { got = append(got, name) })
		want := all[:min(limit, len(all))]
		if n != len(got) || !slices.Equal(got, want) {
			t.Errorf("limit %d: %d entries, differs from fs.WalkDir's first %d", limit, len(got), len(want))
		}
	}
}
