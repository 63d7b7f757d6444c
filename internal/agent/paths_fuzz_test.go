package agent

import (
	"errors"
	"path"
	"strings"
	"testing"
)

// FuzzSplitPath checks the workspace path resolution against what the
// model may pass: whatever it accepts names a place inside the workspace,
// in components the os.Root walk can take one at a time.
func FuzzSplitPath(f *testing.F) {
	f.Add("a/b")
	const root = "/work"
	f.Fuzz(func(t *testing.T, p string) {
		parts, err := splitPath(root, p)
		if err != nil {
			if strings.HasPrefix(path.Clean(p), root+"/") && !strings.Contains(p, "\x00") && len(p) <= maxPathLen &&
				errors.Is(err, ErrOutsideWorkspace) {
				t.Fatalf("%q is under %s but was refused: %v", p, root, err)
			}
			return
		}
		if strings.IndexByte(p, 0) >= 0 || len(p) > maxPathLen {
			t.Fatalf("accepted %q", p)
		}
		for _, c := range parts {
			switch {
			case c == "" || c == "." || c == "..":
				t.Fatalf("%q: component %q", p, c)
			case strings.ContainsAny(c, "/\x00"):
				t.Fatalf("%q: component %q holds a separator or NUL", p, c)
			case len(c) > maxNameLen:
				t.Fatalf("%q: component of %d bytes", p, len(c))
			}
		}
		joined := path.Join(append([]string{root}, parts...)...)
		if joined != root && !strings.HasPrefix(joined, root+"/") {
			t.Fatalf("%q resolves to %s, outside %s", p, joined, root)
		}
		if path.IsAbs(p) {
			return
		}
		// A relative path and the same path under the root agree.
		again, err := splitPath(root, root+"/"+p)
		if err == nil && strings.Join(again, "/") != strings.Join(parts, "/") {
			t.Fatalf("%q and %q resolve differently: %v vs %v", p, root+"/"+p, parts, again)
		}
	})
}
