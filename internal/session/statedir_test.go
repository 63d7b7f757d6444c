package session_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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

// TestStateDirLock: a state directory is held by one server at a time.
// A second waits for the first, then fails naming it; once the first
// lets go, the directory can be taken again. The first lock is the
// control: it shows the file system takes a flock at all.
func TestStateDirLock(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if err := session.PrepareStateDir(dir); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	first, err := session.LockStateDir(context.Background(), dir, 0, log)
	if err != nil {
		t.Fatal(err)
	}
	_, err = session.LockStateDir(context.Background(), dir, 300*time.Millisecond, log)
	if err == nil {
		t.Fatal("a second server took a state directory another holds")
	}
	if want := fmt.Sprintf("in use by another kiln (pid %d on ", os.Getpid()); !strings.Contains(err.Error(), want) {
		t.Errorf("the refusal does not name the holder (%q): %v", want, err)
	}
	// One waiting gets the directory once the holder lets go.
	go func() {
		time.Sleep(200 * time.Millisecond)
		first.Close()
	}()
	second, err := session.LockStateDir(context.Background(), dir, time.Minute, log)
	if err != nil {
		t.Fatalf("the directory was not taken once its holder let go: %v", err)
	}
	second.Close()
}
