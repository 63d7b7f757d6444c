package session_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"kiln/internal/config"
	"kiln/internal/session"
)

// TestPrepareStateDir: a state directory is made private, and one that
// belongs to another user (who could read what kiln saves, or plant
// sessions for it to restore) is refused by config's owner check.
func TestPrepareStateDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if err := session.PrepareStateDir(dir); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	if err := session.PrepareStateDir(dir); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(dir); fi.Mode().Perm() != 0o700 {
		t.Errorf("the state directory has mode %v, want 0700", fi.Mode().Perm())
	}
	if os.Geteuid() != 0 {
		t.Skip("giving the directory to another user needs root")
	}
	if err := os.Chown(dir, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if err := session.PrepareStateDir(dir); !errors.Is(err, config.ErrUnsafeFile) {
		t.Errorf("a state directory of uid 65534: %v", err)
	}
}
