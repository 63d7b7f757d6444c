package session

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"kiln/internal/sandbox"
)

// restoreSnapshot starts a box from a snapshot directory. TEMPORARY until
// sandbox.Restore lands (branch snap): only backends with a Restorer.
func restoreSnapshot(ctx context.Context, b sandbox.Backend, spec sandbox.Spec, dir string) (sandbox.Sandbox, error) {
	raw, err := os.ReadFile(filepath.Join(dir, sandbox.ManifestName))
	if err != nil {
		return nil, err
	}
	var info sandbox.SnapshotInfo
	if err := json.Unmarshal(raw, &info); err != nil {
		return nil, err
	}
	r, ok := b.(sandbox.Restorer)
	if !ok {
		return nil, fmt.Errorf("backend %s cannot restore format %q", b.Name(), info.Format)
	}
	return r.Restore(ctx, spec, dir)
}
