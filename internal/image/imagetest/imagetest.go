// Package imagetest gives tests a kiln-agent binary and a guest image.
//
// Building the image takes minutes (debootstrap and apt), so Image skips
// unless KILN_IMAGE_TEST=1; with it, the image is built once into the
// user's cache (or KILN_IMAGE_CACHE) and reused by later runs.
package imagetest

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"kiln/internal/image"
)

// Env is the variable that enables tests that build or boot the image.
const Env = "KILN_IMAGE_TEST"

var (
	agentOnce sync.Once
	agentPath string
	agentErr  error
)

// Agent builds kiln-agent (static) from this module once per test binary
// and returns its path.
func Agent(t testing.TB) string {
	t.Helper()
	agentOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kiln-agent-")
		if err != nil {
			agentErr = err
			return
		}
		out := filepath.Join(dir, "kiln-agent")
		cmd := exec.Command("go", "build", "-trimpath", "-o", out, "./cmd/kiln-agent")
		cmd.Dir = moduleRoot()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			agentErr = &buildError{string(b), err}
			return
		}
		agentPath = out
	})
	if agentErr != nil {
		t.Fatalf("building kiln-agent: %v", agentErr)
	}
	return agentPath
}

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return e.err.Error() + "\n" + e.out }

func moduleRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// Options returns the image options tests use.
func Options(t testing.TB) image.Options {
	return image.Options{
		CacheDir: os.Getenv("KILN_IMAGE_CACHE"),
		Agent:    Agent(t),
		Logger:   slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo})),
	}
}

// Image returns the guest image built from this tree's agent, building it
// if needed. It skips unless KILN_IMAGE_TEST=1 and the host can build.
func Image(t testing.TB) *image.Image {
	t.Helper()
	if os.Getenv(Env) != "1" {
		t.Skipf("set %s=1 to build and boot the guest image (minutes; needs root, debootstrap, e2fsprogs, network to the Debian archive)", Env)
	}
	if runtime.GOOS != "linux" {
		t.Skip("guest images are built on Linux only")
	}
	if os.Geteuid() != 0 {
		t.Skip("building the guest image needs root")
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		if _, err := os.Stat("/usr/sbin/debootstrap"); err != nil {
			t.Skip("building the guest image needs debootstrap (apt-get install debootstrap)")
		}
	}
	im, err := image.Build(context.Background(), Options(t))
	if err != nil {
		t.Fatalf("building image: %v", err)
	}
	return im
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
