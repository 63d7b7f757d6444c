package session_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// oldLayout moves what the store saved of the principal's session into
// the layout of the kilns before one store (hibernated sessions in
// hibDir/<sha256(principal)[:16] hex>/s-<session>/{owner,snap-<ns>}, named
// snapshots left in the store's tree with no owner file), plus a save an
// old kiln left half-written. It returns the old session directory.
func oldLayout(t *testing.T, storeRoot, hibDir, principal, session string) string {
	t.Helper()
	sum := sha256.Sum256([]byte(principal))
	old := filepath.Join(hibDir, hex.EncodeToString(sum[:16]), "s-"+session)
	if err := os.MkdirAll(old, 0o700); err != nil {
		t.Fatal(err)
	}
	cur := filepath.Join(principalDir(t, storeRoot, principal), "s-"+session)
	snaps, _ := filepath.Glob(filepath.Join(cur, "snap-*"))
	if len(snaps) != 1 {
		t.Fatalf("hibernation saves of %s/%s: %v", principal, session, snaps)
	}
	for _, from := range []string{snaps[0], filepath.Join(cur, "owner")} {
		if err := os.Rename(from, filepath.Join(old, filepath.Base(from))); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(old, "snap-1.tmp"), 0o700); err != nil {
		t.Fatal(err)
	}
	return old
}

// TestUpgradeFromSeparateStores: the hibernated sessions and named
// snapshots of a kiln from before the one store are found after an
// upgrade, for their principal only, and stay found once the new kiln has
// moved them.
func TestUpgradeFromSeparateStores(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: needDill(t)})
	for _, tc := range []struct {
		name string
		// dirs returns the hibernation directory and the snapshot state
		// directory ("": none) of a kiln on base.
		dirs func(base string) (hib, state string)
		// root is where the store keeps its tree.
		root func(base string) string
	}{
		{"state dir", // how kiln runs with --state-dir
			func(base string) (string, string) { return filepath.Join(base, "hibernated"), base },
			func(base string) string { return filepath.Join(base, "snapshots") }},
		{"hibernation dir only",
			func(base string) (string, string) { return base, "" },
			func(base string) string { return base }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			hibDir, state := tc.dirs(base)
			start := func() *session.Manager {
				return hibernating(t, b, hibDir, session.HibernateOptions{CheckpointEvery: -1},
					session.Options{Snapshots: session.SnapshotOptions{StateDir: state}})
			}
			ctx := context.Background()
			mgr := start()
			hibRun(t, mgr, "alice", "s", "x = 41")
			if state != "" {
				s, _ := mgr.Get("alice", "s")
				if _, err := s.Snapshot(ctx, "before"); err != nil {
					t.Fatal(err)
				}
			}
			hibRun(t, mgr, "alice", "s", "x = 50")
			finishes(t, "closing the first manager", mgr.Close)
			old := oldLayout(t, tc.root(base), hibDir, "alice", "s")
			if owners, _ := filepath.Glob(filepath.Join(tc.root(base), "p-*", "s-*", "owner")); len(owners) != 0 {
				t.Fatalf("the fixture keeps owner files in the store's tree: %v", owners)
			}

			mgr2 := start()
			if si := stateOf(mgr2, "alice", "s"); si.State != session.StateHibernated || si.Bytes == 0 {
				t.Errorf("an old kiln's hibernated session after the upgrade: %+v", si)
			}
			if got := mgr2.SessionList("bob"); len(got) != 0 {
				t.Errorf("bob sees %+v", got)
			}
			if _, err := os.Lstat(old); !os.IsNotExist(err) {
				t.Errorf("the old session directory is still there: %v", err)
			}
			out := hibRun(t, mgr2, "bob", "s", "'x' in globals()")
			if out.Result["text/plain"] != "False" || strings.Contains(out.Note, "resumed") {
				t.Errorf("bob's session of the same name: %+v %q", out.ExecResult, out.Note)
			}
			out = hibRun(t, mgr2, "alice", "s", "x + 1")
			if out.Result["text/plain"] != "51" || !strings.Contains(out.Note, resumedNote) {
				t.Fatalf("alice's session after the upgrade: %+v %q", out.ExecResult, out.Note)
			}
			if state != "" {
				list, err := mgr2.Snapshots("alice", "s")
				if err != nil || len(list) != 1 || list[0].Name != "before" {
					t.Fatalf("an old kiln's named snapshots: %+v, %v", list, err)
				}
				if list, _ := mgr2.Snapshots("bob", "s"); len(list) != 0 {
					t.Errorf("bob lists alice's snapshots: %+v", list)
				}
				s, _ := mgr2.Get("alice", "s")
				if _, err := s.Restore(ctx, "before"); err != nil {
					t.Fatalf("restoring an old kiln's named snapshot: %v", err)
				}
				if out := hibRun(t, mgr2, "alice", "s", "x"); out.Result["text/plain"] != "41" {
					t.Errorf("after restoring it: %+v", out.ExecResult)
				}
			}
			hibRun(t, mgr2, "alice", "s", "x = 60")
			finishes(t, "closing the second manager", mgr2.Close)

			mgr3 := start()
			out = hibRun(t, mgr3, "alice", "s", "x + 1")
			if out.Result["text/plain"] != "61" || !strings.Contains(out.Note, resumedNote) {
				t.Errorf("once moved, at the next start: %+v %q", out.ExecResult, out.Note)
			}
			if state != "" {
				if list, _ := mgr3.Snapshots("alice", "s"); len(list) != 1 {
					t.Errorf("named snapshots at the next start: %+v", list)
				}
			}
			// Nothing half-written of the old kiln's is counted or kept
			// where the new one reads.
			filepath.WalkDir(tc.root(base), func(p string, d os.DirEntry, err error) error {
				if err == nil && strings.HasSuffix(d.Name(), ".tmp") {
					t.Errorf("left in the store: %s", p)
				}
				return nil
			})
		})
	}
}

// TestStoreAccount: the store keeps the size of every save it holds
// rather than walking the disk at each save; after saves, replacements,
// deletions, resets and forks its account is what the disk holds.
func TestStoreAccount(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: needDill(t)})
	state := t.TempDir()
	mgr := hibernating(t, b, filepath.Join(state, "hibernated"), session.HibernateOptions{CheckpointEvery: -1},
		session.Options{Snapshots: session.SnapshotOptions{StateDir: state}})
	ctx := context.Background()
	check := func(step string) {
		t.Helper()
		tracked, onDisk := mgr.StoreBytes()
		if tracked != onDisk || onDisk < 0 {
			t.Errorf("after %s: the account holds %d bytes, the disk %d", step, tracked, onDisk)
		}
	}
	snap := func(p, name string) {
		t.Helper()
		s, _ := mgr.Get(p, "s")
		if _, err := s.Snapshot(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	hibRun(t, mgr, "a", "s", "blob = b'x' * 100000")
	snap("a", "one")
	check("a snapshot")
	hibRun(t, mgr, "a", "s", "blob = b'y' * 300000")
	snap("a", "one")
	check("replacing it")
	snap("a", "two")
	if !mgr.HibernateNow("a", "s") {
		t.Fatal("not hibernated")
	}
	check("hibernating")
	hibRun(t, mgr, "a", "s", "blob += b'z'")
	if !mgr.HibernateNow("a", "s") {
		t.Fatal("not hibernated again")
	}
	check("hibernating again")
	if _, err := mgr.Fork(ctx, "a", "s", "f"); err != nil {
		t.Fatal(err)
	}
	check("a fork")
	if err := mgr.DeleteSnapshot("a", "s", "one"); err != nil {
		t.Fatal(err)
	}
	check("deleting a snapshot")
	hibRun(t, mgr, "b", "s", "x = 1")
	if !mgr.HibernateNow("b", "s") || !mgr.Reset("b", "s") {
		t.Fatal("b's session was not hibernated and reset")
	}
	check("a reset")
	if tracked, _ := mgr.StoreBytes(); tracked < 300000 {
		t.Errorf("the account holds %d bytes: the snapshot and the hibernation are not in it", tracked)
	}
}

// TestStoreForeignSessionDir: a session directory whose owner file names
// another principal (a copy, a collision) gives its new principal none of
// what it holds: not the named snapshots, not the hibernated state, not
// even once that principal saves into it.
func TestStoreForeignSessionDir(t *testing.T) {
	b := sessiontest.New(t, &sessiontest.Options{Python: needDill(t)})
	state := t.TempDir()
	start := func() *session.Manager {
		return hibernating(t, b, filepath.Join(state, "hibernated"), session.HibernateOptions{CheckpointEvery: -1},
			session.Options{Snapshots: session.SnapshotOptions{StateDir: state}})
	}
	ctx := context.Background()
	mgr := start()
	hibRun(t, mgr, "alice", "s", "secret = 41")
	s, _ := mgr.Get("alice", "s")
	if _, err := s.Snapshot(ctx, "a1"); err != nil {
		t.Fatal(err)
	}
	hibRun(t, mgr, "bob", "t", "1")
	finishes(t, "closing the first manager", mgr.Close)
	root := filepath.Join(state, "snapshots")
	if err := os.CopyFS(filepath.Join(principalDir(t, root, "bob"), "s-s"), os.DirFS(filepath.Join(principalDir(t, root, "alice"), "s-s"))); err != nil {
		t.Fatal(err)
	}

	mgr2 := start()
	if list, err := mgr2.Snapshots("bob", "s"); err != nil || len(list) != 0 {
		t.Errorf("bob lists the snapshots in alice's copied directory: %+v, %v", list, err)
	}
	bob, _ := mgr2.Get("bob", "s")
	if _, err := bob.Restore(ctx, "a1"); !errors.Is(err, session.ErrNoSnapshot) {
		t.Errorf("bob restores alice's snapshot: %v", err)
	}
	if out := hibRun(t, mgr2, "bob", "s", "'secret' in globals()"); out.Result["text/plain"] != "False" {
		t.Errorf("bob's session s: %+v %q", out.ExecResult, out.Note)
	}
	if _, err := bob.Snapshot(ctx, "b1"); err != nil {
		t.Fatal(err)
	}
	hibRun(t, mgr2, "bob", "s", "mine = 1")
	finishes(t, "closing the second manager", mgr2.Close)

	mgr3 := start()
	list, _ := mgr3.Snapshots("bob", "s")
	if len(list) != 1 || list[0].Name != "b1" {
		t.Errorf("bob's snapshots once he saved into the directory: %+v", list)
	}
	out := hibRun(t, mgr3, "bob", "s", "('secret' in globals(), 'mine' in globals())")
	if out.Result["text/plain"] != "(False, True)" || !strings.Contains(out.Note, resumedNote) {
		t.Errorf("bob's resumed session: %+v %q", out.ExecResult, out.Note)
	}
	out = hibRun(t, mgr3, "alice", "s", "secret + 1")
	if out.Result["text/plain"] != "42" {
		t.Errorf("alice's own session: %+v %q", out.ExecResult, out.Note)
	}
}
