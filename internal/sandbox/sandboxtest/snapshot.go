package sandboxtest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// RunSnapshots checks a backend's state-level snapshots: what a session
// builds (a DataFrame, a function, a class, a lambda, files) survives a
// snapshot and a restore into a fresh box, a generator and an open file
// are named as dropped, the source keeps running unchanged, the restored
// box's random generators differ from the source's, and the restored box
// still refuses a write outside its workspace.
func RunSnapshots(t *testing.T, b sandbox.Backend) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, err := b.Create(ctx, sandbox.Spec{ID: "snap-src", Preload: []string{"numpy", "pandas"}})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	snap, ok := src.(sandbox.Snapshotter)
	if !ok {
		t.Fatalf("%T is not a sandbox.Snapshotter", src)
	}
	mustRun(t, ctx, src, `
import pandas as pd, numpy as np, random, os
df = pd.DataFrame({"a": range(1000), "b": [str(i) for i in range(1000)]})
def double(x):
    return 2 * x
class Point:
    def __init__(self, x): self.x = x
    def norm(self): return abs(self.x)
p = Point(-3)
sq = lambda v: v * v
gen = (i for i in range(3))
fh = open("/tmp/handle.txt", "w")
os.makedirs("sub", exist_ok=True)
open("sub/data.txt", "w").write("hello state")
os.symlink("sub/data.txt", "link")
random.seed(7); np.random.seed(7)
`)
	dir := t.TempDir()
	info, err := snap.Snapshot(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("snapshot: %d bytes in %s; saved %v; dropped %v", info.Bytes, info.Took, info.Saved, info.Dropped)
	if info.Format != sandbox.FormatState || info.SHA256 == "" || info.Bytes <= 0 {
		t.Errorf("manifest %+v", info)
	}
	for _, name := range []string{"df", "double", "Point", "p", "sq", "pd", "np"} {
		if !slices.Contains(info.Saved, name) {
			t.Errorf("%s not saved: %v", name, info.Saved)
		}
	}
	if !slices.ContainsFunc(info.Dropped, func(s string) bool { return strings.HasPrefix(s, "gen: ") && strings.Contains(s, "generator") }) {
		t.Errorf("the generator is not named as dropped: %v", info.Dropped)
	}
	if !slices.ContainsFunc(info.Dropped, func(s string) bool { return strings.HasPrefix(s, "fh: open file handles are not saved") }) {
		t.Errorf("the open file is not named as dropped: %v", info.Dropped)
	}
	if !slices.Contains(info.Dropped, "file link: symbolic links are not saved") {
		t.Errorf("the symlink is not named as dropped: %v", info.Dropped)
	}
	if st, err := os.Stat(filepath.Join(dir, sandbox.StateArchive)); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("archive: %v %v", st, err)
	}

	// The source keeps running, and a change to it after the snapshot
	// does not reach the restored box.
	mustRun(t, ctx, src, `df.loc[0, "a"] = -1; open("sub/data.txt", "w").write("changed")`)

	dst, rep, err := sandbox.RestoreWithReport(ctx, b, sandbox.Spec{ID: "snap-dst"}, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if len(rep.Dropped) != 0 {
		t.Errorf("restore dropped %v", rep.Dropped)
	}
	got := mustRun(t, ctx, dst, `print(int(df["a"].sum()), df.shape, double(21), p.norm(), type(p).__name__, sq(5), open("sub/data.txt").read())`)
	if want := "499500 (1000, 2) 42 3 Point 25 hello state"; strings.TrimSpace(got) != want {
		t.Errorf("restored box printed %q, want %q", got, want)
	}
	got = mustRun(t, ctx, src, `print(int(df["a"].sum()), open("sub/data.txt").read())`)
	if want := "499499 changed"; strings.TrimSpace(got) != want {
		t.Errorf("source printed %q, want %q", got, want)
	}
	// Reseeded: the restored box does not draw what the source draws.
	draw := `print(random.random(), np.random.rand())`
	if a, b := mustRun(t, ctx, src, draw), mustRun(t, ctx, dst, draw); a == b {
		t.Errorf("source and restored box drew the same numbers: %s", a)
	}
	// A fresh box enforces its own restrictions: a write outside the
	// workspace stays denied.
	res, err := dst.RunPython(ctx, `open("/usr/kiln-restored", "w")`, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Error == nil {
		t.Error("a restored box could write /usr")
	}

	// A corrupt archive is refused with a clear error, and no box is left.
	if err := os.WriteFile(filepath.Join(dir, sandbox.StateArchive), []byte("not a tar"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := sandbox.Restore(ctx, b, sandbox.Spec{ID: "snap-bad"}, dir); !errors.Is(err, sandbox.ErrCorruptSnapshot) {
		t.Errorf("restoring a corrupt snapshot: %v, want ErrCorruptSnapshot", err)
	}
}

func mustRun(t *testing.T, ctx context.Context, box sandbox.Sandbox, code string) string {
	t.Helper()
	res, err := box.RunPython(ctx, code, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Error != nil {
		t.Fatalf("%s: %s", res.Error.Name, res.Error.Traceback)
	}
	return res.Stdout.Text
}

// Restoring wraps a backend so that every box it makes is a restored one:
// a fresh box with the state-level snapshot in dir loaded into it, as a
// fork or a rollback makes them. Running the conformance suite on it
// shows that a restored box keeps every restriction. The wrapper keeps the
// backend's leak check.
func Restoring(b sandbox.Backend, dir string) sandbox.Backend {
	return &restoring{Backend: b, dir: dir}
}

type restoring struct {
	sandbox.Backend
	dir string
}

func (r *restoring) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	box, err := r.Backend.Create(ctx, spec)
	if err != nil {
		return nil, err
	}
	if _, err := sandbox.LoadInto(ctx, box, r.dir, r.Name()); err != nil {
		box.Close()
		return nil, err
	}
	return box, nil
}

func (r *restoring) Leftovers() []string {
	if lc, ok := r.Backend.(LeakChecker); ok {
		return lc.Leftovers()
	}
	return nil
}

// StateSnapshot saves a small state-level snapshot (a few globals, no
// files, so a restored box's workspace starts empty as a fresh one's
// does) of a box of b into a new directory and returns it.
func StateSnapshot(t testing.TB, b sandbox.Backend) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "snap-template"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	res, err := box.RunPython(ctx, "restored = {'from': 'a snapshot'}\ndef helper(x):\n    return x", sandbox.ExecOptions{})
	if err != nil || res.Error != nil {
		t.Fatalf("%v %+v", err, res)
	}
	dir := filepath.Join(t.TempDir(), "snap")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := box.(sandbox.Snapshotter).Snapshot(ctx, dir); err != nil {
		t.Fatal(err)
	}
	return dir
}
