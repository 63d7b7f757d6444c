package microvm_test

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"kiln/internal/image/imagetest"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/microvm"
)

// testTimeout bounds one guest operation under TCG, which is slow; it is a
// hang guard, not an assertion about speed.
const testTimeout = 5 * time.Minute

// newBackend returns a TCG backend on the test image, or skips saying what
// is missing. Tests opt in to TCG explicitly, as kiln's users must.
func newBackend(t testing.TB, opts microvm.Options) *microvm.Backend {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("needs qemu-system-x86_64 (apt-get install qemu-system-x86)")
	}
	opts.Image = imagetest.Image(t)
	// Templates saved by an earlier run are usually older than the default
	// age bound, which would start a replacement template in the middle of
	// a test that counts QEMU processes. Tests that rotate ask for it.
	if opts.TemplateMaxAge == 0 {
		opts.TemplateMaxAge = -1
	}
	if opts.TemplateMaxClones == 0 {
		opts.TemplateMaxClones = -1
	}
	if opts.Accel == "" {
		opts.Accel = microvm.AccelTCG
	}
	opts.Verbose = os.Getenv("KILN_TEST_DEBUG") == "1"
	if opts.Verbose {
		opts.RunDir = os.Getenv("KILN_TEST_RUNDIR") // console logs kept there
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: testLogLevel()}))
	}
	b, err := microvm.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("closing backend: %v", err)
		}
	})
	// Not b.Check: it starts a VM (TestCheckStartsAVM), which would add a
	// template and QEMU processes to every test.
	return b
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func create(t testing.TB, b *microvm.Backend, spec sandbox.Spec) sandbox.Sandbox {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	sb, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatalf("creating box: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

func runPython(t testing.TB, sb sandbox.Sandbox, code string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	res, err := sb.RunPython(ctx, code, sandbox.ExecOptions{MaxOutput: 1 << 16})
	if err != nil {
		t.Fatalf("running %q: %v", code, err)
	}
	if res.Error != nil {
		t.Fatalf("running %q: %s: %s\n%s", code, res.Error.Name, res.Error.Value, res.Error.Traceback)
	}
	return res.Stdout.Text
}

// TestRestore makes a fresh template, restores two clones from it, and
// checks that each answers, that they are isolated from each other, and
// what the guest enforces.
func TestRestore(t *testing.T) {
	b := newBackend(t, microvm.Options{StateDir: t.TempDir()})
	spec := sandbox.Spec{ID: "restore-a", Preload: []string{"numpy", "pandas"}}
	a := create(t, b, spec)
	if got := runPython(t, a, "print(2+2)"); got != "4\n" {
		t.Errorf("2+2 printed %q", got)
	}
	spec.ID = "restore-b"
	c := create(t, b, spec)

	runPython(t, a, "open('/work/mine.txt', 'w').write('a')")
	if got := runPython(t, c, "import os; print(os.path.exists('/work/mine.txt'))"); got != "False\n" {
		t.Errorf("clone b sees clone a's file: %q", got)
	}
	// Fresh randomness per clone: the guest reseeds on restore (vmgenid).
	ra := runPython(t, a, "import os; print(os.urandom(16).hex())")
	rc := runPython(t, c, "import os; print(os.urandom(16).hex())")
	if ra == rc {
		t.Errorf("two clones drew the same random bytes %s", ra)
	}

	for _, tc := range []struct{ name, code, want string }{
		{"unprivileged", "import os; print(os.getuid(), os.getgid())", "1000 1000\n"},
		{"preloaded", "import sys; print('pandas' in sys.modules)", "True\n"},
		{"no network", "import socket; print(sorted(n for _, n in socket.if_nameindex()))", "['lo']\n"},
		{"root read-only", "import os\ntry:\n    open('/etc/x', 'w')\nexcept OSError as e:\n    print(e.errno)", "30\n"},
		{"workspace writable", "open('/work/f', 'w').write('x'); print(open('/work/f').read())", "x\n"},
		{"workspace capped", "import os; s = os.statvfs('/work'); print(s.f_blocks * s.f_frsize <= 512 << 20)", "True\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := runPython(t, a, tc.code); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}

	if err := a.Close(); err != nil {
		t.Errorf("closing: %v", err)
	}
	select {
	case <-a.Done():
	default:
		t.Error("Done not closed after Close")
	}
}

// TestColdBoot boots a box without a template.
func TestColdBoot(t *testing.T) {
	b := newBackend(t, microvm.Options{ColdBoot: true})
	sb := create(t, b, sandbox.Spec{ID: "cold", Preload: []string{"json"}})
	if got := runPython(t, sb, "print(6*7)"); got != "42\n" {
		t.Errorf("printed %q", got)
	}
}

// TestKVMNotSilent checks that without KVM the backend refuses rather than
// falling back to emulation.
func TestKVMNotSilent(t *testing.T) {
	if _, err := os.Stat("/dev/kvm"); err == nil {
		t.Skip("host has /dev/kvm")
	}
	b := newBackend(t, microvm.Options{Accel: microvm.AccelKVM})
	if err := b.Check(context.Background()); err == nil {
		t.Error("Check passed without /dev/kvm")
	}
}

// testLogLevel is debug when KILN_TEST_DEBUG=1 (QEMU command lines, step
// timings), else info.
func testLogLevel() slog.Level {
	if os.Getenv("KILN_TEST_DEBUG") == "1" {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}
