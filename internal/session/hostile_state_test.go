package session_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// stallingSave is a cell whose next save stalls: pickling its global
// calls a __reduce__ that touches mark, then waits until release exists.
// A box can do this to every save of itself; it must hold up no one else.
func stallingSave(mark, release string) string {
	return fmt.Sprintf(`class Stall:
    def __reduce__(self):
        import os, time
        open(%[1]q, "w").close()
        while not os.path.exists(%[2]q):
            time.sleep(0.02)
        return (int, ())
stall = Stall()`, mark, release)
}

// A box that stalls its own snapshot holds up no other principal's.
func TestSnapshotStallIsolated(t *testing.T) {
	mgr := withSnapshots(t, session.Options{Snapshots: session.SnapshotOptions{StateDir: t.TempDir()}})
	dir := t.TempDir()
	mark, release := filepath.Join(dir, "mark"), filepath.Join(dir, "release")
	defer os.WriteFile(release, nil, 0o600)
	ctx := context.Background()
	slow := getSessionAs(t, mgr, "slow", "s")
	run(t, slow, stallingSave(mark, release))
	stalled := make(chan error, 1)
	go func() { _, err := slow.Snapshot(ctx, "stuck"); stalled <- err }()
	waitUntil(t, exists(mark), "the stalling save to start")

	other := getSessionAs(t, mgr, "other", "s")
	run(t, other, "x = 1")
	finishes(t, "another principal's snapshot while one box stalls its own", func() {
		if _, err := other.Snapshot(ctx, "mine"); err != nil {
			t.Errorf("another principal's snapshot: %v", err)
		}
	})
	select {
	case err := <-stalled:
		t.Fatalf("the stalled save ended before it was released: %v", err)
	default:
	}
	os.WriteFile(release, nil, 0o600)
	select {
	case err := <-stalled:
		if err != nil {
			t.Errorf("the stalled save, once released: %v", err)
		}
	case <-time.After(liveness):
		t.Fatal("the stalled save does not end once released")
	}
}

// needDill skips a test of state-level snapshots on a python without dill.
func needDill(t *testing.T) string {
	t.Helper()
	py := sessiontest.Python(t)
	if exec.Command(py, "-c", "import dill").Run() != nil {
		t.Skip("needs python3-dill")
	}
	return py
}

// One principal's stalled saves hold up neither another principal's
// hibernation nor the reaper: more of its sessions stall than the reaper
// saves at once, and another principal's idle session is still saved.
func TestReaperStallIsolated(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: needDill(t)})
	dir := t.TempDir()
	mark, release := filepath.Join(dir, "mark"), filepath.Join(dir, "release")
	defer os.WriteFile(release, nil, 0o600)
	mgr := hibernating(t, b, t.TempDir(), session.HibernateOptions{After: 300 * time.Millisecond, CheckpointEvery: -1, SaveTimeout: 10 * time.Minute}, session.Options{})
	for i := range 5 {
		hibRun(t, mgr, "slow", fmt.Sprintf("s%d", i), stallingSave(mark, release))
	}
	waitUntil(t, exists(mark), "a stalling save to start")
	hibRun(t, mgr, "other", "s", "x = 1")
	waitUntil(t, func() bool { return stateOf(mgr, "other", "s").State == session.StateHibernated },
		"another principal's idle session to be hibernated while one principal's saves stall")
	os.WriteFile(release, nil, 0o600)
	for i := range 5 {
		name := fmt.Sprintf("s%d", i)
		waitUntil(t, func() bool { return stateOf(mgr, "slow", name).State == session.StateHibernated },
			"the stalled sessions to be hibernated once released")
	}
}

// lyingSave is a cell that replaces the kernel driver's save with body,
// a function of (path, workspace) returning the driver's answer. The
// driver runs in the code's own process: any cell can do this.
func lyingSave(body string) string {
	return `def _lie():
    import sys
    f = sys._getframe()
    while f is not None and f.f_globals.get("__name__") != "kiln_driver":
        f = f.f_back
    def fake(path, workspace):
` + body + `
    f.f_globals["_state_save"] = fake
_lie()
del _lie`
}

// sparseSave makes the archive a sparse file of n bytes: nothing in the
// box's disk, n bytes for the host to write.
func sparseSave(n int64) string {
	return lyingSave(fmt.Sprintf(`        with open(path, "wb") as fh:
            fh.truncate(%d)
        return {"saved": [], "dropped": []}`, n))
}

// A box that makes its archive huge and sparse gets the quota's error,
// and the host pulls none of it: the quota is checked before writing,
// against the size the box declares. A fork's temporary copy counts too,
// and so does hibernation's quota.
func TestSnapshotQuotaBeforeWriting(t *testing.T) {
	const quota, lie = 1 << 20, 64 << 20
	t.Run("snapshot", func(t *testing.T) {
		mgr, b := withPython(t, session.Options{Snapshots: session.SnapshotOptions{StateDir: t.TempDir(), Quota: quota}})
		needDill(t)
		s := getSession(t, mgr, "q")
		run(t, s, sparseSave(lie))
		before := b.Sent()
		_, err := s.Snapshot(context.Background(), "big")
		t.Log(err)
		if !errors.Is(err, session.ErrSnapshotQuota) {
			t.Errorf("a snapshot of %d bytes against a quota of %d: %v", lie, quota, err)
		}
		if pulled := b.Sent() - before; pulled > quota {
			t.Errorf("the host pulled %d bytes of a snapshot over the quota of %d", pulled, quota)
		}
		if got := run(t, s, "print(1 + 1)"); got != "2" {
			t.Errorf("the session after a refused snapshot: %q", got)
		}
	})
	t.Run("fork", func(t *testing.T) {
		mgr, _ := withPython(t, session.Options{Snapshots: session.SnapshotOptions{StateDir: t.TempDir(), Quota: quota}})
		needDill(t)
		s := getSession(t, mgr, "src")
		run(t, s, fmt.Sprintf("blob = b'x' * %d", 2*quota))
		_, err := mgr.Fork(context.Background(), "local", "src", "dst")
		t.Log(err)
		if !errors.Is(err, session.ErrSnapshotQuota) {
			t.Errorf("a fork whose copy is over the quota: %v", err)
		}
	})
	t.Run("hibernate", func(t *testing.T) {
		b := sessiontest.New(t, &sessiontest.Options{Python: needDill(t)})
		mgr := hibernating(t, b, t.TempDir(), session.HibernateOptions{Quota: quota, CheckpointEvery: -1}, session.Options{})
		hibRun(t, mgr, "local", "h", sparseSave(lie))
		before := b.Sent()
		if mgr.HibernateNow("local", "h") {
			t.Error("a session over the hibernation quota was hibernated")
		}
		if pulled := b.Sent() - before; pulled > quota {
			t.Errorf("the host pulled %d bytes of a save over the hibernation quota of %d", pulled, quota)
		}
	})
}

// A box's save-state answer may name 2×2048 entries of 512 bytes: more
// than a manifest may hold. The snapshot is kept with its lists bounded
// (listed, counted against --max-snapshots, and the result carries no
// megabyte of box text), and a kept snapshot whose manifest cannot be read
// is still listed and counted.
func TestSnapshotLyingManifest(t *testing.T) {
	dir := t.TempDir()
	mgr := withSnapshots(t, session.Options{Snapshots: session.SnapshotOptions{StateDir: dir, Max: 1}})
	ctx := context.Background()
	s := getSession(t, mgr, "lie")
	run(t, s, lyingSave(`        open(path, "wb").close()
        return {"saved": ["s%04d" % i + "x" * 500 for i in range(2048)],
                "dropped": ["d%04d" % i + "y\n" * 250 for i in range(2048)]}`))
	info, err := s.Snapshot(ctx, "one")
	if err != nil {
		t.Fatalf("a snapshot whose box names too much: %v", err)
	}
	var text int
	for _, e := range append(append([]string(nil), info.Saved...), info.Dropped...) {
		text += len(e)
		if strings.Contains(e, "\n") {
			t.Errorf("a line break of the box's in %q", e[:min(len(e), 40)])
			break
		}
	}
	if text > 64<<10 {
		t.Errorf("the snapshot's report holds %d bytes of the box's text", text)
	}
	list, err := mgr.Snapshots("local", "lie")
	if err != nil || len(list) != 1 || list[0].Name != "one" {
		t.Fatalf("listed %v, %v; want the snapshot", list, err)
	}
	if _, err := s.Snapshot(ctx, "two"); !errors.Is(err, session.ErrSnapshotsFull) {
		t.Errorf("a second snapshot past --max-snapshots 1: %v", err)
	}

	// A manifest over the read cap on disk (damage, or an older kiln).
	manifests, _ := filepath.Glob(filepath.Join(dir, "snapshots", "*", "s-lie", "n-one", sandbox.ManifestName))
	if len(manifests) != 1 {
		t.Fatalf("manifests: %v", manifests)
	}
	os.WriteFile(manifests[0], []byte(`{"saved": ["`+strings.Repeat("x", 2<<20)+`"]}`), 0o600)
	list, err = mgr.Snapshots("local", "lie")
	if err != nil || len(list) != 1 || list[0].Name != "one" || list[0].Unreadable == "" {
		t.Errorf("listed %+v, %v; want the unreadable snapshot, saying so", list, err)
	}
	if _, err := s.Snapshot(ctx, "two"); !errors.Is(err, session.ErrSnapshotsFull) {
		t.Errorf("past --max-snapshots 1 with an unreadable snapshot: %v", err)
	}
	if err := mgr.DeleteSnapshot("local", "lie", "one"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Snapshot(ctx, "two"); err != nil {
		t.Errorf("once the unreadable one is deleted: %v", err)
	}
}

// Every principal's snapshots and hibernated sessions together stay within
// StateQuota: a save past it expires the oldest hibernated sessions of any
// principal, and one that still would not fit is refused, expiring none.
func TestStateQuota(t *testing.T) {
	const blob, quota = 300 << 10, 1 << 20
	b := sessiontest.New(t, &sessiontest.Options{Python: needDill(t)})
	state := t.TempDir()
	mgr := hibernating(t, b, filepath.Join(state, "hibernated"), session.HibernateOptions{CheckpointEvery: -1},
		session.Options{Snapshots: session.SnapshotOptions{StateDir: state}, StateQuota: quota})
	ctx := context.Background()
	fill := fmt.Sprintf("blob = b'x' * %d", blob)
	for _, p := range []string{"p1", "p2"} {
		hibRun(t, mgr, p, "s", fill)
		if !mgr.HibernateNow(p, "s") {
			t.Fatalf("%s's session was not hibernated", p)
		}
	}
	snap := func(p string, code string) error {
		hibRun(t, mgr, p, "s", code)
		s, err := mgr.Get(p, "s")
		if err != nil {
			t.Fatal(err)
		}
		_, err = s.Snapshot(ctx, "snap")
		return err
	}
	if err := snap("p3", fill); err != nil {
		t.Fatalf("p3's snapshot within the cap: %v", err)
	}
	if err := snap("p4", fill); err != nil {
		t.Fatalf("p4's snapshot, once the oldest hibernation makes room: %v", err)
	}
	if si := stateOf(mgr, "p1", "s"); si.State == session.StateHibernated {
		t.Error("the oldest hibernated session was not expired to make room")
	}
	if si := stateOf(mgr, "p2", "s"); si.State != session.StateHibernated {
		t.Errorf("p2's hibernated session was expired too: %q", si.State)
	}
	err := snap("p5", fmt.Sprintf("blob = b'x' * %d", 2*blob))
	if !errors.Is(err, session.ErrStateQuota) || !strings.Contains(err.Error(), "--state-quota") {
		t.Errorf("a snapshot that cannot fit even with every hibernation gone: %v", err)
	}
	if si := stateOf(mgr, "p2", "s"); si.State != session.StateHibernated {
		t.Errorf("a refused save expired p2's hibernated session: %q", si.State)
	}
	var used int64
	filepath.WalkDir(state, func(_ string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				used += fi.Size()
			}
		}
		return nil
	})
	if used > quota {
		t.Errorf("the state directory holds %d bytes, over the cap of %d", used, quota)
	}
}
