package session_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// hibernating starts a manager that saves sessions to dir, on b (shared
// by the managers of one test, as a restarted server shares its host).
func hibernating(t *testing.T, b sandbox.Backend, dir string, h session.HibernateOptions, opts session.Options) *session.Manager {
	t.Helper()
	h.Dir = dir
	opts.Backend, opts.Hibernate = b, h
	mgr := session.NewManager(opts)
	t.Cleanup(func() { finishes(t, "closing the manager", mgr.Close) })
	return mgr
}

// forBackends runs f on the in-process backend and, as root, on the jail:
// state-level snapshots are the same mechanism on every agent-hosted
// backend.
func forBackends(t *testing.T, f func(t *testing.T, b sandbox.Backend)) {
	t.Run("inprocess", func(t *testing.T) {
		f(t, sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)}))
	})
	t.Run("jail", func(t *testing.T) { f(t, jailBackend(t, false)) })
}

// hibRun runs code in the principal's session and returns its outcome.
func hibRun(t *testing.T, mgr *session.Manager, principal, name, code string) *session.Outcome {
	t.Helper()
	s, err := mgr.Get(principal, name)
	if err != nil {
		t.Fatal(err)
	}
	out, err := s.RunPython(context.Background(), code, liveness)
	if err != nil {
		t.Fatalf("%s: %v", code, err)
	}
	return out
}

func stateOf(mgr *session.Manager, principal, name string) session.SessionInfo {
	for _, si := range mgr.SessionList(principal) {
		if si.Name == name {
			return si
		}
	}
	return session.SessionInfo{}
}

const resumedNote = "resumed this session from hibernation in "

// TestHibernateIdle: a session idle past After is saved and its box
// destroyed; the next call restores it, and says so.
func TestHibernateIdle(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		mgr := hibernating(t, b, t.TempDir(), session.HibernateOptions{After: 200 * time.Millisecond, CheckpointEvery: -1}, session.Options{})
		hibRun(t, mgr, "local", "s", "x = 41\nimport pandas as pd\ndf = pd.DataFrame({'a': range(1000)})")
		waitUntil(t, func() bool {
			return stateOf(mgr, "local", "s").State == session.StateHibernated && mgr.LiveBoxes() == 0
		}, "the idle session to be hibernated")
		out := hibRun(t, mgr, "local", "s", "x + 1 + int(df.a.sum() == 499500)")
		if out.Result["text/plain"] != "43" || out.Fresh || !strings.Contains(out.Note, resumedNote) {
			t.Fatalf("after hibernation: %+v %+v", out.ExecResult, out)
		}
		if si := stateOf(mgr, "local", "s"); si.State != session.StateLive {
			t.Errorf("after resuming, the session is %q", si.State)
		}
		out = hibRun(t, mgr, "local", "s", "x")
		if strings.Contains(out.Note, "resumed") {
			t.Errorf("the call after the resume says it resumed: %q", out.Note)
		}
	})
}

// TestHibernateRestart: closing the manager saves the live sessions; a
// new manager on the same state directory resumes them at first use.
func TestHibernateRestart(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		dir := t.TempDir()
		mgr := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		hibRun(t, mgr, "local", "s", "x = 41")
		if s, _ := mgr.Get("local", "s"); true {
			if err := s.WithBox(context.Background(), func(box sandbox.Sandbox) error {
				return box.WriteFile(context.Background(), "notes/a.txt", []byte("kept"))
			}); err != nil {
				t.Fatal(err)
			}
		}
		finishes(t, "closing the first manager", mgr.Close)
		if n := mgr.LiveBoxes(); n != 0 {
			t.Fatalf("%d boxes outlive the first manager", n)
		}

		// Only the user running kiln can reach what it saved.
		filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				t.Error(err)
				return nil
			}
			fi, _ := d.Info()
			if want := fs.FileMode(0o600); d.IsDir() && p != dir {
				want = 0o700 | fs.ModeDir
				if fi.Mode() != want {
					t.Errorf("%s has mode %v, want %v", p, fi.Mode(), want)
				}
			} else if !d.IsDir() && fi.Mode() != want {
				t.Errorf("%s has mode %v, want %v", p, fi.Mode(), want)
			}
			return nil
		})
		mgr2 := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		if si := stateOf(mgr2, "local", "s"); si.State != session.StateHibernated || si.Bytes == 0 {
			t.Errorf("list_sessions after the restart: %+v", si)
		}
		out := hibRun(t, mgr2, "local", "s", "x + 1")
		if out.Result["text/plain"] != "42" || !strings.Contains(out.Note, resumedNote) {
			t.Fatalf("after the restart: %+v %+v", out.ExecResult, out)
		}
		out = hibRun(t, mgr2, "local", "s", "open('notes/a.txt').read()")
		if out.Result["text/plain"] != "'kept'" {
			t.Errorf("a workspace file after the restart: %+v", out.ExecResult)
		}
	})
}

// TestHibernateOtherPrincipal: a session is only ever restored for its
// principal. Another's session of the same name is fresh; a session
// directory moved under another principal is refused, not restored.
func TestHibernateOtherPrincipal(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		dir := t.TempDir()
		mgr := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		hibRun(t, mgr, "alice", "s", "secret = 41")
		finishes(t, "closing the first manager", mgr.Close)

		// bob's session directory is a copy of alice's (a hash collision, a
		// mistaken copy): its owner file names alice.
		aliceDir, bobDir := principalDir(t, dir, "alice"), filepath.Join(dir, "bob-dir")
		if err := os.CopyFS(bobDir, os.DirFS(aliceDir)); err != nil {
			t.Fatal(err)
		}
		mgr2 := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		out := hibRun(t, mgr2, "bob", "s", "'secret' in globals()")
		if out.Result["text/plain"] != "False" || strings.Contains(out.Note, "resumed") {
			t.Errorf("bob's session s: %+v %q", out.ExecResult, out.Note)
		}
		if got := stateOf(mgr2, "bob", "s"); got.State != session.StateLive {
			t.Errorf("bob sees his session as %+v", got)
		}
		hibRun(t, mgr2, "bob", "t", "1") // bob's directory now exists
		finishes(t, "closing the second manager", mgr2.Close)
		bobReal := principalDir(t, dir, "bob")
		os.RemoveAll(filepath.Join(bobReal, "s-s"))
		if err := os.Rename(filepath.Join(bobDir, "s-s"), filepath.Join(bobReal, "s-s")); err != nil {
			t.Fatal(err)
		}
		mgr3 := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		for _, si := range mgr3.SessionList("bob") {
			if si.Name == "s" {
				t.Errorf("bob's list shows alice's session: %+v", si)
			}
		}
		out = hibRun(t, mgr3, "bob", "s", "'secret' in globals()")
		if out.Result["text/plain"] != "False" || !strings.Contains(out.Note, "could not be read") {
			t.Errorf("bob's session s with alice's owner file: %+v %q", out.ExecResult, out.Note)
		}
		out = hibRun(t, mgr3, "alice", "s", "secret + 1")
		if out.Result["text/plain"] != "42" || !strings.Contains(out.Note, resumedNote) {
			t.Errorf("alice's own session: %+v %q", out.ExecResult, out.Note)
		}
	})
}

// principalDir finds the directory the principal's sessions are saved in
// (the one whose owner files name it).
func principalDir(t *testing.T, dir, principal string) string {
	t.Helper()
	pents, _ := os.ReadDir(dir)
	for _, p := range pents {
		sents, _ := os.ReadDir(filepath.Join(dir, p.Name()))
		for _, s := range sents {
			b, err := os.ReadFile(filepath.Join(dir, p.Name(), s.Name(), "owner"))
			if err == nil && strings.Contains(string(b), `"principal":"`+principal+`"`) {
				return filepath.Join(dir, p.Name())
			}
		}
	}
	t.Fatalf("no saved session of %s under %s", principal, dir)
	return ""
}

// TestHibernateTTL: a saved session older than the TTL is deleted and the
// next call starts fresh.
func TestHibernateTTL(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		dir := t.TempDir()
		mgr := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		hibRun(t, mgr, "local", "s", "x = 41")
		finishes(t, "closing the first manager", mgr.Close)
		mgr2 := hibernating(t, b, dir, session.HibernateOptions{After: 100 * time.Millisecond, TTL: 300 * time.Millisecond, CheckpointEvery: -1}, session.Options{})
		waitUntil(t, func() bool { return len(mgr2.SessionList("local")) == 0 }, "the saved session to expire")
		out := hibRun(t, mgr2, "local", "s", "'x' in globals()")
		if out.Result["text/plain"] != "False" || strings.Contains(out.Note, "resumed") {
			t.Errorf("after the TTL: %+v %q", out.ExecResult, out.Note)
		}
	})
}

// TestHibernateQuota: past a principal's quota, saving a session expires
// that principal's oldest saved ones; a snapshot larger than the whole
// quota is not kept; other principals are untouched.
func TestHibernateQuota(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		dir := t.TempDir()
		const quota = 1 << 20
		h := session.HibernateOptions{Quota: quota, CheckpointEvery: -1}
		mgr := hibernating(t, b, dir, h, session.Options{})
		// Random bytes: the archive is compressed or not, they stay ~400 KiB.
		fill := "import os\nblob = os.urandom(400 << 10)"
		hibRun(t, mgr, "local", "old", fill)
		hibRun(t, mgr, "other", "old", fill)
		finishes(t, "closing the first manager", mgr.Close)
		time.Sleep(10 * time.Millisecond) // the next saves are newer

		mgr2 := hibernating(t, b, dir, h, session.Options{})
		hibRun(t, mgr2, "local", "mid", fill)
		hibRun(t, mgr2, "local", "new", fill)
		hibRun(t, mgr2, "local", "huge", "import os\nhuge = os.urandom(2 << 20)")
		finishes(t, "closing the second manager", mgr2.Close)

		mgr3 := hibernating(t, b, dir, h, session.Options{})
		var names []string
		var total int64
		for _, si := range mgr3.SessionList("local") {
			names = append(names, si.Name)
			total += si.Bytes
		}
		if strings.Join(names, ",") != "mid,new" || total > quota {
			t.Errorf("saved sessions %v (%d bytes), want mid,new within %d bytes: the oldest expired, the one over the quota not kept", names, total, quota)
		}
		if got := mgr3.SessionList("other"); len(got) != 1 {
			t.Errorf("another principal's saved sessions: %+v", got)
		}
	})
}

// TestHibernateCheckpoint: a live session is saved in the background
// after a call once its last save is older than CheckpointEvery, so a
// server killed without closing (kill -9) leaves it on disk.
func TestHibernateCheckpoint(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		dir := t.TempDir()
		h := session.HibernateOptions{CheckpointEvery: time.Nanosecond}
		mgr := hibernating(t, b, dir, h, session.Options{})
		hibRun(t, mgr, "local", "s", "x = 41")
		hibRun(t, mgr, "local", "s", "x = x") // its mark was set by the first call
		waitUntil(t, func() bool { return !stateOf(mgr, "local", "s").Saved.IsZero() }, "a checkpoint")
		if si := stateOf(mgr, "local", "s"); si.State != session.StateLive {
			t.Errorf("a checkpointed session is %q, want live", si.State)
		}
		// A second server on the same directory while the first never closed.
		mgr2 := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		out := hibRun(t, mgr2, "local", "s", "x + 1")
		if out.Result["text/plain"] != "42" || !strings.Contains(out.Note, resumedNote) {
			t.Errorf("from the checkpoint: %+v %q", out.ExecResult, out.Note)
		}
	})
}

// TestHibernateReset: reset_session forgets a saved session too.
func TestHibernateReset(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		dir := t.TempDir()
		mgr := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		hibRun(t, mgr, "local", "s", "x = 41")
		finishes(t, "closing the first manager", mgr.Close)
		mgr2 := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
		if !mgr2.Reset("local", "s") {
			t.Error("resetting a saved session reports nothing to reset")
		}
		out := hibRun(t, mgr2, "local", "s", "'x' in globals()")
		if out.Result["text/plain"] != "False" || !out.Fresh {
			t.Errorf("after the reset: %+v %+v", out.ExecResult, out)
		}
	})
}

// TestHibernatedDoNotCount: hibernated sessions do not count against the
// live session quotas; resuming one does.
func TestHibernatedDoNotCount(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		mgr := hibernating(t, b, t.TempDir(), session.HibernateOptions{After: 200 * time.Millisecond, CheckpointEvery: -1},
			session.Options{MaxSessionsPerPrincipal: 1})
		hibRun(t, mgr, "local", "a", "x = 1")
		waitUntil(t, func() bool { return stateOf(mgr, "local", "a").State == session.StateHibernated }, "a to hibernate")
		hibRun(t, mgr, "local", "b", "y = 2")
		s, err := mgr.Get("local", "a")
		if err != nil {
			t.Fatal(err)
		}
		_, err = s.RunPython(context.Background(), "x", liveness)
		if !errors.Is(err, session.ErrTooMany) {
			t.Errorf("resuming past the quota: %v", err)
		}
		mgr.Reset("local", "b")
		out := hibRun(t, mgr, "local", "a", "x")
		if out.Result["text/plain"] != "1" || !strings.Contains(out.Note, resumedNote) {
			t.Errorf("resuming within the quota: %+v %q", out.ExecResult, out.Note)
		}
	})
}

// TestHibernateCorrupt: a damaged saved session gives a clear note and a
// fresh sandbox, never a crash, and is not tried again.
func TestHibernateCorrupt(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		for _, tc := range []struct {
			name   string
			damage func(snap string) error
		}{
			{"truncated archive", func(snap string) error {
				return os.Truncate(filepath.Join(snap, sandbox.StateArchive), 10)
			}},
			{"garbage manifest", func(snap string) error {
				return os.WriteFile(filepath.Join(snap, sandbox.ManifestName), []byte("{not json"), 0o600)
			}},
			{"unknown format", func(snap string) error {
				return os.WriteFile(filepath.Join(snap, sandbox.ManifestName), []byte(`{"format":"kiln-state/99"}`), 0o600)
			}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				dir := t.TempDir()
				mgr := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
				hibRun(t, mgr, "local", "s", "x = 41")
				finishes(t, "closing the first manager", mgr.Close)
				snaps, _ := filepath.Glob(filepath.Join(principalDir(t, dir, "local"), "s-s", "snap-*"))
				if len(snaps) != 1 {
					t.Fatalf("snapshots on disk: %v", snaps)
				}
				if err := tc.damage(snaps[0]); err != nil {
					t.Fatal(err)
				}
				mgr2 := hibernating(t, b, dir, session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
				out := hibRun(t, mgr2, "local", "s", "'x' in globals()")
				if out.Result["text/plain"] != "False" || !out.Fresh || !strings.Contains(out.Note, "could not be") {
					t.Errorf("a damaged snapshot: %+v %+v", out.ExecResult, out)
				}
				if got := mgr2.SessionList("local"); len(got) != 1 || got[0].State != session.StateLive || !got[0].Saved.IsZero() {
					t.Errorf("after a damaged snapshot: %+v", got)
				}
			})
		}
	})
}

// TestHibernateFork: a hibernated session, found on disk after a restart,
// can be forked: the fork wakes it first.
func TestHibernateFork(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		dir := t.TempDir()
		h := session.HibernateOptions{CheckpointEvery: -1}
		mgr := hibernating(t, b, dir, h, session.Options{})
		hibRun(t, mgr, "local", "s", "x = 41")
		finishes(t, "closing the first manager", mgr.Close)
		mgr2 := hibernating(t, b, dir, h, session.Options{Snapshots: session.SnapshotOptions{StateDir: dir}})
		if _, err := mgr2.Fork(context.Background(), "local", "s", "f"); err != nil {
			t.Fatalf("forking a hibernated session: %v", err)
		}
		if out := hibRun(t, mgr2, "local", "f", "x + 1"); out.Result["text/plain"] != "42" {
			t.Errorf("the fork: %+v", out.ExecResult)
		}
		if si := stateOf(mgr2, "local", "s"); si.State != session.StateLive {
			t.Errorf("the forked source is %+v", si)
		}
	})
}

// TestHibernateExpiredInMemory: a session hibernated by this server whose
// save then expires gets a fresh sandbox with a note saying why.
func TestHibernateExpiredInMemory(t *testing.T) {
	forBackends(t, func(t *testing.T, b sandbox.Backend) {
		mgr := hibernating(t, b, t.TempDir(), session.HibernateOptions{After: 100 * time.Millisecond, TTL: 400 * time.Millisecond, CheckpointEvery: -1}, session.Options{})
		hibRun(t, mgr, "local", "s", "x = 41")
		waitUntil(t, func() bool { return stateOf(mgr, "local", "s").State == session.StateHibernated }, "the session to hibernate")
		waitUntil(t, func() bool {
			return stateOf(mgr, "local", "s").State == session.StateNew || stateOf(mgr, "local", "s").State == ""
		}, "its save to expire")
		out := hibRun(t, mgr, "local", "s", "'x' in globals()")
		if out.Result["text/plain"] != "False" || !out.Fresh || !strings.Contains(out.Note, "has since expired") {
			t.Errorf("after the save expired: %+v %+v", out.ExecResult, out)
		}
	})
}
