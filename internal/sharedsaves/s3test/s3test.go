// Package s3test starts a real S3-compatible server for tests: versitygw
// (Apache-2.0) on a POSIX directory, built from the Go module proxy by
// `make s3-server` into kiln's cache. Tests that need it skip without it,
// and fail without it when KILN_TEST_S3=1 (make test sets it).
package s3test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Version is the versitygw `make s3-server` builds.
const Version = "v1.8.0"

// Binary finds versitygw: $KILN_VERSITYGW, kiln's cache
// (~/.cache/kiln/tools/versitygw-<Version>/versitygw), or $PATH.
func Binary() (string, error) {
	if p := os.Getenv("KILN_VERSITYGW"); p != "" {
		return p, nil
	}
	if dir, err := os.UserCacheDir(); err == nil {
		p := filepath.Join(dir, "kiln", "tools", "versitygw-"+Version, "versitygw")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p, nil
	}
	return "", fmt.Errorf("no versitygw (S3 server for the tests): run `make s3-server`, or set KILN_VERSITYGW")
}

// Server is a running versitygw with one bucket.
type Server struct {
	Endpoint string // http://127.0.0.1:port
	Bucket   string
	Access   string
	Secret   string
	Dir      string // where it keeps the objects
	cmd      *exec.Cmd
}

// Start runs versitygw for t with an empty bucket, and sets
// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to its keys for t (so t
// must not be parallel).
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		if os.Getenv("KILN_TEST_S3") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	dir := t.TempDir()
	for _, d := range []string{"data", "meta"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	s := &Server{Bucket: "kiln-saves", Access: "kiln" + token(4), Secret: token(16), Dir: filepath.Join(dir, "data")}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	s.Endpoint = "http://" + addr
	log, err := os.Create(filepath.Join(dir, "versitygw.log"))
	if err != nil {
		t.Fatal(err)
	}
	s.cmd = exec.Command(bin, "--quiet", "--port", addr, "posix", "--sidecar", filepath.Join(dir, "meta"), s.Dir)
	// The keys by the environment, never the command line.
	s.cmd.Env = append(os.Environ(), "ROOT_ACCESS_KEY_ID="+s.Access, "ROOT_SECRET_ACCESS_KEY="+s.Secret)
	s.cmd.Stdout, s.cmd.Stderr = log, log
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.cmd.Process.Kill()
		s.cmd.Wait()
		log.Close()
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("versitygw's log:\n%s", b)
		}
	})
	t.Setenv("AWS_ACCESS_KEY_ID", s.Access)
	t.Setenv("AWS_SECRET_ACCESS_KEY", s.Secret)
	c := s.Client(t)
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err = c.MakeBucket(ctx, s.Bucket, minio.MakeBucketOptions{})
		cancel()
		if err == nil {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("versitygw at %s never made its bucket: %v", addr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Client is an S3 client of the server with its root keys, for a test to
// look at or tamper with what kiln keeps.
func (s *Server) Client(t testing.TB) *minio.Client {
	c, err := minio.New(strings.TrimPrefix(s.Endpoint, "http://"), &minio.Options{
		Creds: credentials.NewStaticV4(s.Access, s.Secret, ""), BucketLookup: minio.BucketLookupPath, Region: "us-east-1"})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Stop kills the server: storage that stops answering.
func (s *Server) Stop() {
	s.cmd.Process.Kill()
	s.cmd.Wait()
}

func token(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
