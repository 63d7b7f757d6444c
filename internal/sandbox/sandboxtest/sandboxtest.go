// Package sandboxtest is the conformance suite every kiln backend runs: the
// behaviour and the security contract of a box, checked against real boxes.
package sandboxtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// Options tune the suite for slow backends.
type Options struct {
	// Scale multiplies every timeout (a microVM under TCG wants 10).
	Scale float64
	// Limits for boxes made by the suite; zero fields take small defaults.
	Limits sandbox.Limits
	// HostProcesses is true when the box's processes are host processes
	// (jail), so the suite can look for leftovers in the host's /proc.
	HostProcesses bool
	// MemoryBombKillsBox is true when going over the memory limit kills
	// the whole box rather than the process inside it (gVisor: no OOM
	// killer inside the sandbox, the host cgroup kills the sandbox). The
	// memory bomb then must end in sandbox.ErrDied or an error result, and
	// a new box from the backend must work; the session layer replaces a
	// box that died. So may an inode fill, when the backend's tmpfs has no
	// inode cap and its files count against the memory limit (gVisor).
	MemoryBombKillsBox bool
	// OwnKernel is true when the box's code runs on a kernel of its own
	// (microvm), not under kiln's syscall policy (internal/boxpolicy/syscalls.go):
	// the hostile syscall case then only requires that the box cannot
	// create namespaces, and logs what the guest kernel answers otherwise.
	OwnKernel bool
	// NoShell, when set, says why the backend's boxes have no shell
	// (wasm: Python in WebAssembly, no operating system). Cases that need
	// one skip with that reason; the rest run, some through Python.
	NoShell string
	// NoOS, when set, says why code in the backend's boxes reaches no
	// operating system (wasm: libc's syscalls, signals, processes and
	// threads do not exist there). Cases that probe the kernel's
	// mechanisms skip with that reason.
	NoOS string
	// NoMemoryLimit, when set, says why the backend's boxes have no
	// memory limit on this host (a rootless jail where no cgroup is
	// delegated to the user: rlimits only). The memory bombs skip with
	// that reason; a backend that has one never sets it.
	NoMemoryLimit string
	// NoInodeCap, when set, says why the backend's tmpfs have no inode
	// cap, though the box plan gives them one (gVisor: runsc's tmpfs
	// refuses nr_inodes). The plan case then does not ask for it; the
	// inode fill must still end in a refusal or in the box's memory limit.
	NoInodeCap string
	// PlanUnverified, when set, says why the plan case has not yet been
	// seen to pass on the backend. The probe still runs and its reading
	// and the plan are logged; the checks skip with the reason, so that
	// the first run shows what differs without failing it. Clear it once
	// a run passes.
	PlanUnverified string
	// PlatformTmpfs, when set, says why the box's tmpfs are the
	// platform's, mounted without nosuid and nodev and with the
	// platform's mode and owner (Kubernetes: the kubelet's memory-backed
	// emptyDirs), and why that is safe. The plan case then checks only
	// their type and size, and logs the rest.
	PlatformTmpfs string
	// NoNodev, when set, says why the backend's tmpfs are not mounted
	// nodev, though the box plan says so (gVisor: runsc ignores the
	// option). The plan case then logs their mount options.
	NoNodev string
	// NoProcMasks, when set, says why the box plan's /proc masks are not
	// there and need not be (gVisor: runsc ignores maskedPaths, and its
	// /proc is the sentry's own). The plan case then logs what it finds.
	NoProcMasks string
	// OtherSyscallPolicy, when set, says why the box's code runs under a
	// seccomp filter other than kiln's syscall policy (Kubernetes without
	// kiln's profile on its nodes: the runtime's default profile). The
	// plan case then still wants a filter, and logs what its probes get.
	OtherSyscallPolicy string
	// NoPlanEnv, when set, says why code in the backend's boxes does not
	// get the box plan's environment.
	NoPlanEnv string
}

var (
	agentOnce sync.Once
	agentPath string
	agentErr  error
)

// PrebuiltEnv names a directory holding kiln and kiln-agent built ahead
// (the field-host VM has no Go toolchain): BuildAgent and BuildKiln then
// return those instead of building.
const PrebuiltEnv = "KILN_TEST_BIN_DIR"

// BuildAgent builds kiln-agent (static) once per test binary and returns
// its path.
func BuildAgent(t testing.TB) string {
	t.Helper()
	agentOnce.Do(func() {
		if dir := os.Getenv(PrebuiltEnv); dir != "" {
			agentPath = filepath.Join(dir, "kiln-agent")
			_, agentErr = os.Stat(agentPath)
			return
		}
		out, err := exec.Command("go", "env", "GOMOD").Output()
		if err != nil {
			agentErr = fmt.Errorf("finding module root: %w", err)
			return
		}
		root := filepath.Dir(strings.TrimSpace(string(out)))
		dir, err := os.MkdirTemp("", "kiln-agent-")
		if err != nil {
			agentErr = err
			return
		}
		os.Chmod(dir, 0o755) // boxes run as uids that must reach it
		agentPath = filepath.Join(dir, "kiln-agent")
		cmd := exec.Command("go", "build", "-o", agentPath, "./cmd/kiln-agent")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = fmt.Errorf("building kiln-agent: %v\n%s", err, out)
		}
	})
	if agentErr != nil {
		t.Fatal(agentErr)
	}
	return agentPath
}

type suite struct {
	b    sandbox.Backend
	opts Options
	n    int
	mu   sync.Mutex
}

// Run runs the suite against b.
func Run(t *testing.T, b sandbox.Backend) { RunWith(t, b, Options{}) }

// RunWith runs the suite with options.
func RunWith(t *testing.T, b sandbox.Backend, opts Options) {
	if opts.Scale == 0 {
		opts.Scale = 1
	}
	if s, err := strconv.ParseFloat(os.Getenv("KILN_TEST_TIMEOUT_SCALE"), 64); err == nil && s > 0 {
		opts.Scale *= s
	}
	l := &opts.Limits
	if l.MemoryBytes == 0 {
		l.MemoryBytes = 256 << 20
	}
	if l.WorkspaceBytes == 0 {
		l.WorkspaceBytes = 32 << 20
	}
	if l.TmpBytes == 0 {
		l.TmpBytes = 16 << 20
	}
	if l.Pids == 0 {
		l.Pids = 64
	}
	s := &suite{b: b, opts: opts}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.fn(t, s) })
	}
	runHostile(t, s)
}

func (s *suite) timeout(d time.Duration) time.Duration {
	return time.Duration(float64(d) * s.opts.Scale)
}

func (s *suite) ctx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout(d))
	t.Cleanup(cancel)
	return ctx
}

func (s *suite) box(t *testing.T) sandbox.Sandbox {
	t.Helper()
	return s.boxPreloading(t, nil)
}

// boxPreloading is box with modules the kernel imports before the box is
// handed out (in a backend's template, if it has one).
func (s *suite) boxPreloading(t *testing.T, preload []string) sandbox.Sandbox {
	t.Helper()
	s.mu.Lock()
	s.n++
	id := fmt.Sprintf("conf%d-%d", os.Getpid(), s.n)
	s.mu.Unlock()
	box, err := s.b.Create(s.ctx(t, 60*time.Second), sandbox.Spec{ID: id, Limits: s.opts.Limits, Preload: preload})
	if err != nil {
		t.Fatalf("creating box: %v", err)
	}
	t.Cleanup(func() { box.Close() })
	return box
}

func py(t *testing.T, s *suite, box sandbox.Sandbox, code string) *resultView {
	t.Helper()
	res, err := box.RunPython(s.ctx(t, 60*time.Second), code, sandbox.ExecOptions{})
	if err != nil {
		t.Fatalf("run_python %q: %v", code, err)
	}
	return view(res)
}

// pyOK is py for set-up code, which must not raise.
func pyOK(t *testing.T, s *suite, box sandbox.Sandbox, code string) *resultView {
	t.Helper()
	r := py(t, s, box, code)
	if r.Error != nil {
		t.Fatalf("setting up: %s: %s\n%s", r.Error.Name, r.Error.Value, r.Error.Traceback)
	}
	return r
}

func sh(t *testing.T, s *suite, box sandbox.Sandbox, command string) *resultView {
	t.Helper()
	s.needShell(t)
	res, err := box.RunShell(s.ctx(t, 60*time.Second), command, sandbox.ExecOptions{})
	if err != nil {
		t.Fatalf("run_shell %q: %v", command, err)
	}
	return view(res)
}

// needShell skips a case that needs a shell on a backend without one.
func (s *suite) needMemoryLimit(t *testing.T) {
	t.Helper()
	if s.opts.NoMemoryLimit != "" {
		t.Skipf("needs a memory limit, and %s", s.opts.NoMemoryLimit)
	}
}

func (s *suite) needShell(t *testing.T) {
	t.Helper()
	if s.opts.NoShell != "" {
		t.Skipf("needs a shell, and %s", s.opts.NoShell)
	}
}

// needOS skips a case that probes the kernel's mechanisms on a backend
// whose code reaches no operating system.
func (s *suite) needOS(t *testing.T) {
	t.Helper()
	if s.opts.NoOS != "" {
		t.Skipf("probes the kernel's mechanisms, and %s", s.opts.NoOS)
	}
}

// hostListener starts a TCP server on the host's loopback and returns its
// port; a box must not reach it.
func hostListener(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("HOST-SECRET\n"))
			c.Close()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

// leftovers lists host processes whose command line contains marker.
func leftovers(marker string) []string {
	var out []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err == nil && strings.Contains(string(b), marker) {
			out = append(out, e.Name()+": "+strings.ReplaceAll(string(b), "\x00", " "))
		}
	}
	return out
}
