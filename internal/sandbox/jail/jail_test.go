package jail_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

func TestMain(m *testing.M) {
	jail.MaybeInit()
	os.Exit(m.Run())
}

// timeoutScale is KILN_TEST_TIMEOUT_SCALE (the field-host VM under TCG
// sets it), or 1.
func timeoutScale() float64 {
	if s, err := strconv.ParseFloat(os.Getenv("KILN_TEST_TIMEOUT_SCALE"), 64); err == nil && s > 0 {
		return s
	}
	return 1
}

// scaled stretches d by timeoutScale.
func scaled(d time.Duration) time.Duration { return time.Duration(float64(d) * timeoutScale()) }

func newBackend(t testing.TB) *jail.Backend {
	t.Helper()
	if os.Getuid() != 0 {
		if err := rootlessPremise(); err != nil {
			t.Skipf("the jail tests need root, or a user with a uid per box: %v", err)
		}
	}
	agent := sandboxtest.BuildAgent(t)
	b, err := jail.New(jail.Options{Agent: agent})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestConformance(t *testing.T) {
	b := newBackend(t)
	opts := sandboxtest.Options{HostProcesses: true}
	if err := cgroupError(b); err != nil {
		if os.Getuid() == 0 {
			t.Fatalf("root without cgroup limits: %v", err)
		}
		opts.NoMemoryLimit = fmt.Sprintf("this rootless backend has none: %v", err)
	}
	sandboxtest.RunWith(t, b, opts)
}

// TestSeccompVictims runs each denied operation in a box and sees it refused.
func TestSeccompVictims(t *testing.T) {
	b := newBackend(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "victims"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	victims := map[string]string{
		"unshare user ns": "import os; os.unshare(os.CLONE_NEWUSER)",
		"unshare net ns":  "import os; os.unshare(os.CLONE_NEWNET)",
		"mount":           "import ctypes; l=ctypes.CDLL(None,use_errno=True); r=l.mount(b'none',b'/tmp',b'tmpfs',0,None); assert r==0, ctypes.get_errno()",
		"ptrace":          "import ctypes; l=ctypes.CDLL(None,use_errno=True); r=l.ptrace(16,1,0,0); assert r==0, ctypes.get_errno()",
		"raw socket":      "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)",
		"packet socket":   "import socket; socket.socket(17, socket.SOCK_RAW, 0)",
		"bpf":             "import ctypes; l=ctypes.CDLL(None,use_errno=True); r=l.syscall(321,0,0,0); assert r==0, ctypes.get_errno()",
		"keyctl":          "import ctypes; l=ctypes.CDLL(None,use_errno=True); r=l.syscall(250,0,0,0); assert r>=0, ctypes.get_errno()",
		"chroot":          "import os; os.chroot('/tmp')",
		"setuid root":     "import os; os.setuid(0)",
		"write /usr":      "open('/usr/kiln-test','w')",
		"write /etc":      "open('/etc/kiln-test','w')",
		"write /proc/sys": "open('/proc/sys/kernel/hostname','w').write('x')",
		"sysrq":           "open('/proc/sysrq-trigger','w').write('b')",
		"mknod":           "import os, stat; os.mknod('/tmp/sda', stat.S_IFBLK|0o600, os.makedev(8,0))",
	}
	for name, code := range victims {
		t.Run(name, func(t *testing.T) {
			res, err := box.RunPython(ctx, code, sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if res.Error == nil {
				t.Errorf("%s succeeded in the box", name)
			}
		})
	}
	// Threads and subprocesses still work: clone3 falls back to clone.
	res, err := box.RunPython(ctx, "import subprocess, threading\nt=threading.Thread(target=print); t.start(); t.join()\nsubprocess.run(['true']).returncode", sandbox.ExecOptions{})
	if err != nil || res.Error != nil || res.Result["text/plain"] != "0" {
		t.Errorf("threads/subprocess: %v %+v", err, res)
	}
}

func TestNotRootOnHost(t *testing.T) {
	b := newBackend(t)
	ctx := context.Background()
	box, err := b.Create(ctx, sandbox.Spec{ID: "whoami"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	res, err := box.RunShell(ctx, "id -u; cat /proc/self/status | grep -E '^(CapEff|CapBnd|NoNewPrivs)'", sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := res.Stdout.Text
	for _, want := range []string{"1000\n", "CapEff:\t0000000000000000", "CapBnd:\t0000000000000000", "NoNewPrivs:\t1"} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
	_ = exec.Command
	_ = filepath.Join
}

// TestServerUmask: a server running under a tight umask (the systemd
// unit's UMask=0077) still builds boxes whose /etc, /dev and agent its
// box user can reach: numpy finds its BLAS through /etc/alternatives.
// Found by the field-host VM (make fieldhost-test), where every call
// failed with "libblas.so.3: cannot open shared object file".
func TestServerUmask(t *testing.T) {
	newBackend(t)
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	for _, zygote := range []bool{false, true} {
		t.Run(fmt.Sprintf("zygote=%v", zygote), func(t *testing.T) {
			b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Zygote: zygote})
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			ctx, cancel := context.WithTimeout(context.Background(), scaled(time.Minute))
			defer cancel()
			box, err := b.Create(ctx, sandbox.Spec{ID: fmt.Sprintf("umask-%v", zygote)})
			if err != nil {
				t.Fatal(err)
			}
			defer box.Close()
			res, err := box.RunPython(ctx, "import numpy\nint(numpy.arange(10).sum())", sandbox.ExecOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if res.Error != nil || res.Result["text/plain"] != "45" {
				t.Errorf("numpy in a box of a server with umask 077: %+v %s", res.Error, res.Stderr.Text)
			}
		})
	}
}
