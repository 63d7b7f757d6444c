package session_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// withSnapshots is withPython on a python that has dill.
func withSnapshots(t *testing.T, opts session.Options) *session.Manager {
	t.Helper()
	if exec.Command(sessiontest.Python(t), "-c", "import dill").Run() != nil {
		t.Skip("needs python3-dill")
	}
	mgr, _ := withPython(t, opts)
	return mgr
}

func run(t *testing.T, s *session.Session, code string) string {
	t.Helper()
	out, err := s.RunPython(context.Background(), code, liveness)
	if err != nil {
		t.Fatal(err)
	}
	if out.Error != nil {
		t.Fatalf("%s: %s", out.Error.Name, out.Error.Traceback)
	}
	return strings.TrimSpace(out.Stdout.Text)
}

// A fork has the source's variables and files; a destructive step in the
// fork leaves the source as it was.
func TestForkDiverges(t *testing.T) {
	mgr := withSnapshots(t, session.Options{})
	ctx := context.Background()
	src := getSession(t, mgr, "src")
	run(t, src, "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3]})\nf = lambda x: x + 1\nopen('keep.txt', 'w').write('kept')")
	rep, err := mgr.Fork(ctx, "local", "src", "dst")
	if err != nil {
		t.Fatal(err)
	}
	if rep.Info.Bytes <= 0 || !slices.Contains(rep.Info.Saved, "df") {
		t.Errorf("fork report %+v", rep.Info)
	}
	dst, ok := mgr.Lookup("local", "dst")
	if !ok {
		t.Fatal("the fork is not a session")
	}
	if got := run(t, dst, "print(int(df.a.sum()), f(1), open('keep.txt').read())"); got != "6 2 kept" {
		t.Errorf("fork: %q", got)
	}
	run(t, dst, "import os\ndel df\nos.remove('keep.txt')")
	if got := run(t, src, "print(int(df.a.sum()), open('keep.txt').read())"); got != "6 kept" {
		t.Errorf("source after the fork's destructive step: %q", got)
	}
	// Another principal sees neither session, and cannot fork into or
	// from them.
	if _, err := mgr.Fork(ctx, "other", "src", "mine"); err == nil {
		t.Error("another principal forked the session")
	}
	if _, err := mgr.Fork(ctx, "local", "src", "dst"); !errors.Is(err, session.ErrSnapshotExists) {
		t.Errorf("forking onto a live session: %v", err)
	}
}

// A rollback restores the snapshot's state; a cap on kept snapshots says
// how to free one; another principal cannot restore or list them.
func TestSnapshotRollback(t *testing.T) {
	dir := t.TempDir()
	mgr := withSnapshots(t, session.Options{Snapshots: session.SnapshotOptions{StateDir: dir, Max: 2}})
	ctx := context.Background()
	s := getSession(t, mgr, "work")
	run(t, s, "x = 1\nopen('data.txt', 'w').write('v1')")
	info, err := s.Snapshot(ctx, "one")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("snapshot: %d bytes in %s", info.Bytes, info.Took)
	run(t, s, "x = 2\nopen('data.txt', 'w').write('v2')\nimport os; os.mkdir('extra')")
	if _, err := s.Restore(ctx, "one"); err != nil {
		t.Fatal(err)
	}
	if got := run(t, s, "import os\nprint(x, open('data.txt').read(), os.path.exists('extra'))"); got != "1 v1 False" {
		t.Errorf("after rollback: %q", got)
	}
	if _, err := s.Snapshot(ctx, "two"); err != nil {
		t.Fatal(err)
	}
	_, err = s.Snapshot(ctx, "three")
	if !errors.Is(err, session.ErrSnapshotsFull) || !strings.Contains(err.Error(), "delete_snapshot") {
		t.Errorf("over the cap: %v", err)
	}
	if _, err := s.Snapshot(ctx, "two"); err != nil { // replacing is fine
		t.Errorf("replacing a snapshot: %v", err)
	}
	if l, _ := mgr.Snapshots("local", "work"); len(l) != 2 {
		t.Errorf("listed %d snapshots", len(l))
	}
	if l, _ := mgr.Snapshots("other", "work"); len(l) != 0 {
		t.Errorf("another principal lists %d snapshots", len(l))
	}
	o := getSessionAs(t, mgr, "other", "work")
	if _, err := o.Restore(ctx, "one"); !errors.Is(err, session.ErrNoSnapshot) {
		t.Errorf("another principal restoring: %v", err)
	}
	if err := mgr.DeleteSnapshot("local", "work", "one"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Restore(ctx, "one"); !errors.Is(err, session.ErrNoSnapshot) {
		t.Errorf("restoring a deleted snapshot: %v", err)
	}
	// Kept under the state directory, readable by its owner only.
	st, err := os.Stat(filepath.Join(dir, "snapshots"))
	if err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("snapshot root: %v %v", st, err)
	}
}

// A corrupt snapshot gives a clear error, and the session keeps its box.
func TestRestoreCorrupt(t *testing.T) {
	dir := t.TempDir()
	mgr := withSnapshots(t, session.Options{Snapshots: session.SnapshotOptions{StateDir: dir}})
	ctx := context.Background()
	s := getSession(t, mgr, "c")
	run(t, s, "y = 41")
	if _, err := s.Snapshot(ctx, "snap"); err != nil {
		t.Fatal(err)
	}
	archives, _ := filepath.Glob(filepath.Join(dir, "snapshots", "*", "s-c", "n-snap", "state.tar"))
	if len(archives) != 1 {
		t.Fatalf("archives: %v", archives)
	}
	os.WriteFile(archives[0], []byte("garbage"), 0o600)
	run(t, s, "y = 42")
	_, err := s.Restore(ctx, "snap")
	if err == nil || !strings.Contains(err.Error(), "corrupt") {
		t.Errorf("restoring a corrupt snapshot: %v", err)
	}
	if got := run(t, s, "print(y)"); got != "42" {
		t.Errorf("after a failed restore: %q", got)
	}
}

// The quota counts the principal's snapshot bytes.
func TestSnapshotQuota(t *testing.T) {
	mgr := withSnapshots(t, session.Options{Snapshots: session.SnapshotOptions{Quota: 4096}})
	s := getSession(t, mgr, "q")
	run(t, s, "blob = b'x' * 100000")
	_, err := s.Snapshot(context.Background(), "big")
	if !errors.Is(err, session.ErrSnapshotQuota) {
		t.Fatalf("over the quota: %v", err)
	}
	if l, _ := mgr.Snapshots("local", "q"); len(l) != 0 {
		t.Errorf("a snapshot over the quota was kept: %v", l)
	}
}

func getSessionAs(t *testing.T, mgr *session.Manager, principal, name string) *session.Session {
	t.Helper()
	s, err := mgr.Get(principal, name)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// plainBackend's boxes have no optional abilities, as the wasm backend's
// have no snapshots.
type plainBackend struct{ *sessiontest.Backend }

func (b plainBackend) Name() string { return "wasm" }
func (b plainBackend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	box, err := b.Backend.Create(ctx, spec)
	if err != nil {
		return nil, err
	}
	return struct{ sandbox.Sandbox }{box}, nil
}

// A backend whose boxes cannot save themselves says so by name.
func TestSnapshotUnsupported(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	mgr := session.NewManager(session.Options{Backend: plainBackend{b}})
	defer mgr.Close()
	s := getSession(t, mgr, "w")
	run(t, s, "x = 1")
	_, err := s.Snapshot(context.Background(), "n")
	if !errors.Is(err, session.ErrNoSnapshotBoxes) || !strings.Contains(err.Error(), "not supported on the wasm backend") {
		t.Errorf("snapshot: %v", err)
	}
	_, err = mgr.Fork(context.Background(), "local", "w", "w2")
	if !errors.Is(err, session.ErrNoSnapshotBoxes) {
		t.Errorf("fork: %v", err)
	}
}
