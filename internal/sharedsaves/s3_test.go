package sharedsaves_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"kiln/internal/sharedsaves"
	"kiln/internal/sharedsaves/s3test"
)

func open(t *testing.T, s *s3test.Server, prefix string) *sharedsaves.Bucket {
	t.Helper()
	b, err := sharedsaves.Open(context.Background(), sharedsaves.Options{Bucket: "s3://" + s.Bucket + prefix, Endpoint: s.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestBucket puts, reads, replaces, expires and deletes saves on a real
// S3 server.
func TestBucket(t *testing.T) {
	s := s3test.Start(t)
	b := open(t, s, "/team/a")
	ctx := context.Background()
	if _, err := b.Stat(ctx, "k1"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Stat of nothing: %v, want fs.ErrNotExist", err)
	}
	if _, _, err := b.Get(ctx, "k1"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Get of nothing: %v, want fs.ErrNotExist", err)
	}
	saved := time.Unix(0, 1764000000123456789)
	if err := b.Put(ctx, "k1", saved, 5, strings.NewReader("first")); err != nil {
		t.Fatal(err)
	}
	// An unknown length, as a streamed tar may be.
	later := saved.Add(time.Second)
	if err := b.Put(ctx, "k1", later, -1, strings.NewReader("second save")); err != nil {
		t.Fatal(err)
	}
	st, err := b.Stat(ctx, "k1")
	if err != nil || !st.Saved.Equal(later) || st.Size != int64(len("second save")) {
		t.Fatalf("Stat: %+v %v, want saved %v, 11 bytes", st, err, later)
	}
	body, got, err := b.Get(ctx, "k1")
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(body)
	body.Close()
	if string(data) != "second save" || !got.Saved.Equal(later) {
		t.Fatalf("Get: %q %+v", data, got)
	}
	// The object is under the prefix, named by the key alone.
	c := s.Client(t)
	if _, err := c.StatObject(ctx, s.Bucket, "team/a/k1", minio.StatObjectOptions{}); err != nil {
		t.Fatalf("the object is not at team/a/k1: %v", err)
	}
	// A body that fails leaves the save before it.
	if err := b.Put(ctx, "k1", later.Add(time.Second), -1, io.MultiReader(strings.NewReader("half"), failing{})); err == nil {
		t.Fatal("a Put whose body failed succeeded")
	}
	if st, err := b.Stat(ctx, "k1"); err != nil || !st.Saved.Equal(later) {
		t.Fatalf("after a failed Put: %+v %v, want the save of %v", st, err, later)
	}
	// An object kiln did not write is not a save.
	if _, err := c.PutObject(ctx, s.Bucket, "team/a/k2", bytes.NewReader([]byte("x")), 1, minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Stat(ctx, "k2"); err == nil || errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Stat of an object without kiln's metadata: %v, want an error", err)
	}
	// Expire: the cutoff in the future takes all but what keep keeps,
	// and nothing outside the prefix.
	if _, err := c.PutObject(ctx, s.Bucket, "team/other", bytes.NewReader([]byte("y")), 1, minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	if n, err := b.Expire(ctx, time.Now().Add(-time.Hour), func(string) bool { return false }); err != nil || n != 0 {
		t.Fatalf("Expire of an hour ago: %d %v, want 0 removed", n, err)
	}
	n, err := b.Expire(ctx, time.Now().Add(time.Hour), func(k string) bool { return k == "k2" })
	if err != nil || n != 1 {
		t.Fatalf("Expire: %d %v, want 1 removed", n, err)
	}
	if _, err := b.Stat(ctx, "k1"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("k1 after Expire: %v", err)
	}
	if _, err := c.StatObject(ctx, s.Bucket, "team/other", minio.StatObjectOptions{}); err != nil {
		t.Fatalf("Expire removed an object outside its prefix: %v", err)
	}
	if err := b.Delete(ctx, "k2"); err != nil {
		t.Fatal(err)
	}
	if err := b.Delete(ctx, "k2"); err != nil {
		t.Fatalf("Delete of nothing: %v", err)
	}
}

type failing struct{}

func (failing) Read([]byte) (int, error) { return 0, errors.New("the save went away") }

// TestOpenRefuses: what cannot work is said at start, not at the first
// save.
func TestOpenRefuses(t *testing.T) {
	s := s3test.Start(t)
	ctx := context.Background()
	for _, c := range []struct {
		o    sharedsaves.Options
		want string
	}{
		{sharedsaves.Options{Bucket: "kiln-saves"}, "want s3://BUCKET"},
		{sharedsaves.Options{Bucket: "s3:///x"}, "want s3://BUCKET"},
		{sharedsaves.Options{Bucket: "s3://bkt/a//x"}, "plain path"},
		{sharedsaves.Options{Bucket: "s3://b", Endpoint: "ftp://h"}, "want https://host"},
		{sharedsaves.Options{Bucket: "s3://b", Endpoint: "https://h/path"}, "want https://host"},
		{sharedsaves.Options{Bucket: "s3://nope", Endpoint: s.Endpoint}, `no bucket "nope"`},
	} {
		if _, err := sharedsaves.Open(ctx, c.o); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Open(%+v): %v, want %q", c.o, err, c.want)
		}
	}
	t.Setenv("AWS_SECRET_ACCESS_KEY", "wrong")
	if _, err := sharedsaves.Open(ctx, sharedsaves.Options{Bucket: "s3://" + s.Bucket, Endpoint: s.Endpoint}); err == nil || !strings.Contains(err.Error(), "AWS_ACCESS_KEY_ID") {
		t.Errorf("Open with a wrong secret: %v, want an error that says where keys come from", err)
	}
}
