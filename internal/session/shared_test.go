package session_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
	"kiln/internal/sharedsaves"
	"kiln/internal/sharedsaves/s3test"
)

// sharing is a manager of its own state directory whose saves are shared
// in the server's bucket.
func sharing(t *testing.T, srv *s3test.Server, every time.Duration) *session.Manager {
	t.Helper()
	b, err := sharedsaves.Open(context.Background(), sharedsaves.Options{Bucket: "s3://" + srv.Bucket + "/saves", Endpoint: srv.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	backend := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
	return hibernating(t, backend, t.TempDir(), session.HibernateOptions{CheckpointEvery: every, Shared: b}, session.Options{})
}

func objectOf(t *testing.T, srv *s3test.Server, principal, name string) (minio.ObjectInfo, error) {
	return srv.Client(t).StatObject(context.Background(), srv.Bucket, "saves/"+session.SharedKey(principal, name), minio.StatObjectOptions{})
}

// TestSharedSaves: a session saved by one server resumes on another that
// shares its bucket and not its disk, from the newest save either made;
// a reset removes it from the bucket. The control, a server with neither
// the disk nor the bucket, starts the session afresh.
func TestSharedSaves(t *testing.T) {
	srv := s3test.Start(t)
	a := sharing(t, srv, time.Nanosecond)
	hibRun(t, a, "alice", "s", "x = 41")
	hibRun(t, a, "alice", "s", "x = x") // its first checkpoint is due after this call
	waitUntil(t, func() bool { _, err := objectOf(t, srv, "alice", "s"); return err == nil }, "the checkpoint in the bucket")
	// a is never closed: it and its box are as good as lost to b.

	control := hibernating(t, sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)}), t.TempDir(), session.HibernateOptions{CheckpointEvery: -1}, session.Options{})
	if out := hibRun(t, control, "alice", "s", "'x' in globals()"); out.Result["text/plain"] != "False" {
		t.Fatalf("the control, with no shared saves, found the session: %+v", out.ExecResult)
	}

	b := sharing(t, srv, time.Nanosecond)
	if _, ok := b.Lookup("alice", "s"); !ok {
		t.Error("Lookup on a server with the session only in the bucket found nothing")
	}
	out := hibRun(t, b, "alice", "s", "x + 1")
	if out.Result["text/plain"] != "42" || !strings.Contains(out.Note, "resumed this session from its last save in shared storage in ") {
		t.Fatalf("from the bucket: %+v %q", out.ExecResult, out.Note)
	}
	// Another principal's session of the same name is not alice's.
	if out := hibRun(t, b, "bob", "s", "'x' in globals()"); out.Result["text/plain"] != "False" {
		t.Fatalf("bob's session s has alice's variables: %+v", out.ExecResult)
	}

	// b's save is newer than a's: a third server on a's disk would
	// resume a's; with the bucket it resumes b's.
	hibRun(t, b, "alice", "s", "x = 100")
	before, _ := objectOf(t, srv, "alice", "s")
	hibRun(t, b, "alice", "s", "x = x")
	b.WaitShared()
	waitUntil(t, func() bool {
		o, err := objectOf(t, srv, "alice", "s")
		return err == nil && o.ETag != before.ETag
	}, "b's checkpoint in the bucket")
	c := sharing(t, srv, -1)
	if out := hibRun(t, c, "alice", "s", "x"); out.Result["text/plain"] != "100" {
		t.Fatalf("the newest save is b's (x = 100): %+v %q", out.ExecResult, out.Note)
	}
	if !c.Reset("alice", "s") {
		t.Error("Reset found nothing to reset")
	}
	if _, err := objectOf(t, srv, "alice", "s"); minio.ToErrorResponse(err).Code != minio.NoSuchKey {
		t.Fatalf("the save is still in the bucket after a reset: %v", err)
	}
}

// TestSharedSavesDown: storage that stops answering costs a warning, not
// a session: saves stay on the server's own disk.
func TestSharedSavesDown(t *testing.T) {
	srv := s3test.Start(t)
	a := sharing(t, srv, -1)
	hibRun(t, a, "alice", "s", "x = 41")
	srv.Stop()
	if !a.HibernateNow("alice", "s") {
		t.Fatal("the session was not hibernated with its storage down")
	}
	a.WaitShared()
	out := hibRun(t, a, "alice", "s", "x + 1")
	if out.Result["text/plain"] != "42" || !strings.Contains(out.Note, resumedNote) {
		t.Fatalf("from the local save with the bucket down: %+v %q", out.ExecResult, out.Note)
	}
}

// TestSharedSaveTampered: a save in the bucket is input. An archive that
// reaches outside its directory, links, devices, a file larger than it
// says: each is refused, nothing is written outside, and the session
// starts afresh with a note, the server unharmed.
func TestSharedSaveTampered(t *testing.T) {
	entry := func(name string, typ byte, body string) func(*tar.Writer) {
		return func(tw *tar.Writer) {
			tw.WriteHeader(&tar.Header{Name: name, Typeflag: typ, Size: int64(len(body)), Mode: 0o777, Linkname: "/etc/passwd"})
			tw.Write([]byte(body))
		}
	}
	archive := func(es ...func(*tar.Writer)) []byte {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, e := range es {
			e(tw)
		}
		tw.Close()
		return b.Bytes()
	}
	for _, c := range []struct {
		name string
		tar  []byte
		want string
	}{
		{"dot-dot", archive(entry("../escape", tar.TypeReg, "x")), "outside"},
		{"absolute", archive(entry("/tmp/escape", tar.TypeReg, "x")), "outside"},
		{"unclean", archive(entry("a/../../escape", tar.TypeReg, "x")), "outside"},
		{"symlink", archive(entry("link", tar.TypeSymlink, "")), "neither a file"},
		{"hardlink", archive(entry("link", tar.TypeLink, "")), "neither a file"},
		{"device", archive(entry("dev", tar.TypeChar, "")), "neither a file"},
		{"fifo", archive(entry("fifo", tar.TypeFifo, "")), "neither a file"},
		{"no parent", archive(entry("a/b", tar.TypeReg, "x")), "no such file"},
		{"twice", archive(entry("f", tar.TypeReg, "x"), entry("f", tar.TypeReg, "y")), "twice"},
		{"too big", archive(entry("f", tar.TypeReg, strings.Repeat("x", 2000))), "larger"},
		{"not a tar", []byte("this is not an archive at all, and it goes on for a while past a header block"), "readable"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "save")
			os.Mkdir(dir, 0o700)
			err := session.Unpack(bytes.NewReader(c.tar), dir, 1024)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Unpack: %v, want %q", err, c.want)
			}
			parent := filepath.Dir(dir)
			ents, _ := os.ReadDir(parent)
			if len(ents) != 1 {
				t.Errorf("Unpack wrote beside its directory: %v", ents)
			}
			filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
				if err == nil && !d.IsDir() && !d.Type().IsRegular() {
					t.Errorf("Unpack left %s, of type %v", p, d.Type())
				}
				return nil
			})
		})
	}

	// What pack writes, unpack takes back whole, and packedSize is its
	// length.
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "d", "e"), 0o700)
	os.WriteFile(filepath.Join(src, "manifest.json"), []byte(`{"format":"state"}`), 0o600)
	os.WriteFile(filepath.Join(src, "d", "e", "big"), bytes.Repeat([]byte("k"), 5000), 0o600)
	var b bytes.Buffer
	if err := session.Pack(src, &b); err != nil {
		t.Fatal(err)
	}
	if n, err := session.PackedSize(src); err != nil || n != int64(b.Len()) {
		t.Fatalf("PackedSize %d %v, the archive is %d bytes", n, err, b.Len())
	}
	dst := filepath.Join(t.TempDir(), "save")
	os.Mkdir(dst, 0o700)
	if err := session.Unpack(bytes.NewReader(b.Bytes()), dst, int64(b.Len())); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(dst, "d", "e", "big")); len(got) != 5000 {
		t.Fatalf("round trip: %d bytes", len(got))
	}
	// A symlink in a save is not put.
	os.Symlink("/etc/passwd", filepath.Join(src, "link"))
	if err := session.Pack(src, &b); err == nil {
		t.Fatal("Pack put a symlink")
	}

	// Through a server: a tampered object in alice's key gives a fresh
	// session and a warning, and nothing outside the store.
	srv := s3test.Start(t)
	bad := archive(entry("../../../../escape", tar.TypeReg, "x"))
	if _, err := srv.Client(t).PutObject(context.Background(), srv.Bucket, "saves/"+session.SharedKey("alice", "s"), bytes.NewReader(bad), int64(len(bad)),
		minio.PutObjectOptions{UserMetadata: map[string]string{"Kiln-Saved": "1764000000000000000"}}); err != nil {
		t.Fatal(err)
	}
	m := sharing(t, srv, -1)
	out := hibRun(t, m, "alice", "s", "'x' in globals()")
	if out.Result["text/plain"] != "False" {
		t.Fatalf("a tampered save: %+v", out.ExecResult)
	}
	// The test's temporary directories hold the store; the name would
	// land in one of them, or in their parent, or above.
	for dir := filepath.Dir(t.TempDir()); ; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "escape")); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("the tampered save wrote %s: %v", filepath.Join(dir, "escape"), err)
		}
		if dir == "/" {
			break
		}
	}
	filepath.WalkDir(filepath.Dir(t.TempDir()), func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Name() == "escape" {
			t.Errorf("the tampered save wrote %s", p)
		}
		return nil
	})
}
