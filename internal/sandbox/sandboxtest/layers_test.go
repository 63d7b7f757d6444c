package sandboxtest

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestNoUpperLayers: the conformance suite of the sandbox layer imports
// nothing of the layers above it (session, mcpserver, cli), so every
// backend can run it without them; cases that need those layers live
// with them (sessiontest.RunPerCall).
func TestNoUpperLayers(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	above := []string{"kiln/internal/session", "kiln/internal/mcpserver", "kiln/internal/cli"}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			for _, a := range above {
				if path == a || strings.HasPrefix(path, a+"/") {
					t.Errorf("%s imports %s, a layer above the sandbox", name, path)
				}
			}
		}
	}
}
