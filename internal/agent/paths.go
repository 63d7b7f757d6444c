package agent

import (
	"errors"
	"fmt"
	"path"
	"strings"
)

const (
	maxPathLen = 4096
	maxNameLen = 255
)

// ErrOutsideWorkspace is returned for a path that leaves the workspace.
var ErrOutsideWorkspace = errors.New("path is outside the workspace")

// splitPath turns a path given by the model into the components of a path
// relative to the workspace root. Absolute paths are accepted only when they
// lie under the root; ".." may not climb out of it. An empty result means
// the root itself. The components are not yet checked for symlinks: the
// walk that opens them refuses those.
func splitPath(root, p string) ([]string, error) {
	if strings.IndexByte(p, 0) >= 0 {
		return nil, errors.New("path contains a NUL byte")
	}
	if len(p) > maxPathLen {
		return nil, fmt.Errorf("path is longer than %d bytes", maxPathLen)
	}
	if path.IsAbs(p) {
		clean := path.Clean(p)
		root = path.Clean(root)
		switch {
		case clean == root:
			return nil, nil
		case strings.HasPrefix(clean, root+"/"):
			p = strings.TrimPrefix(clean, root+"/")
		default:
			return nil, fmt.Errorf("%w: %q (paths are relative to the workspace %s)", ErrOutsideWorkspace, p, root)
		}
	}
	clean := path.Clean(p)
	if clean == "." || clean == "" {
		return nil, nil
	}
	if clean == ".." || strings.HasPrefix(clean, "../") {
		return nil, fmt.Errorf("%w: %q", ErrOutsideWorkspace, p)
	}
	parts := strings.Split(clean, "/")
	for _, c := range parts {
		if len(c) > maxNameLen {
			return nil, fmt.Errorf("a path component is longer than %d bytes", maxNameLen)
		}
	}
	return parts, nil
}
