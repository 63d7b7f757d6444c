package jail_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

var _ sandboxtest.LeakChecker = (*jail.Backend)(nil)

// ownGroup is this test server's group under a controller's root
// (kiln/<pid>, or kiln/pidns<inode>.<pid> in a container's pid namespace).
func ownGroup() string {
	return strings.ReplaceAll(jail.ServerCgroupPattern(), "{pid}", strconv.Itoa(os.Getpid()))
}

// boxPids lists the host pids in this server's box cgroups.
func boxPids(t *testing.T) []int {
	t.Helper()
	groups, _ := filepath.Glob(fmt.Sprintf("/sys/fs/cgroup/pids/%s/*/cgroup.procs", ownGroup()))
	if len(groups) == 0 {
		groups, _ = filepath.Glob(fmt.Sprintf("/sys/fs/cgroup/%s/*/cgroup.procs", ownGroup()))
	}
	var pids []int
	for _, g := range groups {
		b, _ := os.ReadFile(g)
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
	}
	return pids
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestKilledMidCall kills the agent, or the box's init, while a call runs:
// the call ends with a clear SandboxDied result and the session's next
// call runs in a fresh box.
func TestKilledMidCall(t *testing.T) {
	b := newBackend(t)
	victims := map[string]func(pid int) bool{
		// The agent is the box's PID 1 (the box init below) in both ways
		// of making a box; picked by name it is the same process.
		"agent": func(pid int) bool {
			comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
			return string(bytes.TrimSpace(comm)) == "kiln-agent"
		},
		"box init": func(pid int) bool {
			st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:]))
			return len(f) > 1 && f[1] == strconv.Itoa(os.Getpid())
		},
		"everything": func(int) bool { return true },
	}
	for name, pick := range victims {
		t.Run(name, func(t *testing.T) {
			mgr := session.NewManager(session.Options{Backend: b, PoolSize: 0, DefaultTimeout: time.Minute})
			defer mgr.Close()
			sess, err := mgr.Get("test", "killed")
			if err != nil {
				t.Fatal(err)
			}
			marker := "killed-" + strconv.Itoa(6000000+os.Getpid()%100000)
			type result struct {
				out *session.Outcome
				err error
			}
			done := make(chan result, 1)
			go func() {
				out, err := sess.RunShell(context.Background(), "exec -a "+marker+" sleep 600", time.Minute)
				done <- result{out, err}
			}()
			waitFor(t, func() bool { return len(sandboxtest.Leftovers(marker)) > 0 }, "the call to start")
			killed := 0
			for _, pid := range boxPids(t) {
				if pick(pid) {
					syscall.Kill(pid, syscall.SIGKILL)
					killed++
				}
			}
			if killed == 0 {
				t.Fatalf("found no %s to kill among %v", name, boxPids(t))
			}
			r := <-done
			if r.err != nil {
				t.Fatalf("the call failed instead of reporting the death: %v", r.err)
			}
			if !r.out.Restarted || r.out.Error == nil || r.out.Error.Name != "SandboxDied" {
				t.Errorf("outcome: restarted %v, error %+v, note %q", r.out.Restarted, r.out.Error, r.out.Note)
			}
			waitFor(t, func() bool { return len(sandboxtest.Leftovers(marker)) == 0 }, "the call's process to die")
			next, err := sess.RunPython(context.Background(), "6 * 7", time.Minute)
			if err != nil || next.Result["text/plain"] != "42" || !next.Fresh {
				t.Errorf("the next call: %+v %v", next, err)
			}
		})
	}
}

// TestServerKilled kills `kiln mcp` with SIGKILL mid-call, with the zygote
// and without, and with every process of its boxes stopped first (a box
// wedged by its own code cannot notice its stream closing): its boxes die
// with it all the same, and the next kiln to start removes the cgroups and
// mount points it left.
func TestServerKilled(t *testing.T) {
	newBackend(t)
	for _, c := range []struct {
		name   string
		zygote bool
		wedge  bool
	}{
		{"zygote", true, false},
		{"zygote, box stopped", true, true},
		{"direct", false, false},
		{"direct, box stopped", false, true},
	} {
		t.Run(c.name, func(t *testing.T) { serverKilled(t, c.zygote, c.wedge) })
	}
}

func serverKilled(t *testing.T, zygote, wedge bool) {
	srv := sandboxtest.StartStdio(t, "--pool", "1", "--preload", "", "--zygote="+strconv.FormatBool(zygote))
	srv.Initialize(t)
	marker := "server-killed-" + strconv.Itoa(6000000+os.Getpid()%100000)
	srv.Send(t, `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"run_shell","arguments":{"command":"(exec -a `+marker+` sleep 600) & wait","timeout_s":300}}}`)
	waitFor(t, func() bool { return len(sandboxtest.Leftovers(marker)) > 0 }, "the call to start")
	pid := srv.Cmd.Process.Pid
	group := strings.ReplaceAll(jail.ServerCgroupPattern(), "{pid}", strconv.Itoa(pid))
	owned := func() []string {
		var out []string
		for _, pat := range []string{"/sys/fs/cgroup/*/" + group, "/sys/fs/cgroup/" + group, filepath.Join(os.TempDir(), "kiln-jail", fmt.Sprintf("root-%d.*", pid))} {
			m, _ := filepath.Glob(pat)
			out = append(out, m...)
		}
		return out
	}
	if len(owned()) == 0 {
		t.Fatalf("the server owns no cgroup or mount point; the check is blind")
	}
	if wedge {
		procs, _ := filepath.Glob("/sys/fs/cgroup/pids/" + group + "/*/cgroup.procs")
		v2, _ := filepath.Glob("/sys/fs/cgroup/" + group + "/*/cgroup.procs")
		stopped := 0
		for _, f := range append(procs, v2...) {
			b, _ := os.ReadFile(f)
			for _, p := range strings.Fields(string(b)) {
				if n, err := strconv.Atoi(p); err == nil && syscall.Kill(n, syscall.SIGSTOP) == nil {
					stopped++
					// Whatever the outcome, nothing stopped here outlives the test.
					t.Cleanup(func() { syscall.Kill(n, syscall.SIGKILL) })
				}
			}
		}
		if stopped == 0 {
			t.Fatalf("stopped no process of the server's boxes; the check is blind")
		}
	}
	srv.Cmd.Process.Kill()
	srv.Cmd.Wait()
	waitFor(t, func() bool { return len(sandboxtest.Leftovers(marker)) == 0 }, "the boxes to die with their server")
	left := owned()
	t.Logf("left by the killed server: %v", left)
	var logs bytes.Buffer
	if _, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Logger: slog.New(slog.NewTextHandler(&logs, nil))}); err != nil {
		t.Fatal(err)
	}
	if l := owned(); len(l) > 0 {
		t.Errorf("a restarted kiln left the orphans of %d: %v\n%s", pid, l, logs.String())
	}
	if len(left) > 0 && !strings.Contains(logs.String(), "orphaned") {
		t.Errorf("the restart did not say what it removed:\n%s", logs.String())
	}
}

// TestStateDirFull puts the mount points on a full filesystem: creating a
// box fails with a clear error, and works again once there is room.
func TestStateDirFull(t *testing.T) {
	newBackend(t)
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=64k,nr_inodes=16"); err != nil {
		t.Skipf("mounting a small tmpfs: %v", err)
	}
	defer syscall.Unmount(dir, syscall.MNT_DETACH)
	// Box roots are uids no one has: they must traverse to their mount point.
	os.Chmod(filepath.Dir(dir), 0o711)
	os.Chmod(dir, 0o711)
	state := filepath.Join(dir, "state")
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), StateDir: state})
	if err != nil {
		t.Fatal(err)
	}
	var fill []string
	for i := 0; ; i++ {
		p := filepath.Join(dir, "fill"+strconv.Itoa(i))
		if os.WriteFile(p, bytes.Repeat([]byte("x"), 4096), 0o600) != nil {
			break
		}
		fill = append(fill, p)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = b.Create(ctx, sandbox.Spec{ID: "full"})
	if err == nil || !strings.Contains(err.Error(), "no space left") {
		t.Errorf("creating a box on a full disk: %v", err)
	}
	t.Logf("on a full disk: %v", err)
	for _, p := range fill {
		os.Remove(p)
	}
	box, err := b.Create(ctx, sandbox.Spec{ID: "room"})
	if err != nil {
		t.Fatalf("after freeing space: %v", err)
	}
	defer box.Close()
	if res, err := box.RunShell(ctx, "echo ok", sandbox.ExecOptions{}); err != nil || res.Stdout.Text != "ok\n" {
		t.Errorf("after freeing space: %+v %v", res, err)
	}
}

// TestCgroupsReadOnly starts the backend where the cgroup filesystem is
// read-only (a private mount namespace with every cgroup mount bound
// read-only): kiln still starts, says boxes have rlimits only, and runs
// them.
func TestCgroupsReadOnly(t *testing.T) {
	if os.Getenv("KILN_TEST_RO_CGROUP") == "1" {
		roCgroupChild(t)
		return
	}
	newBackend(t)
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("needs unshare(1)")
	}
	script := `set -e
for m in $(awk '$3 ~ /^cgroup/ || $2 == "/sys/fs/cgroup" {print $2}' /proc/mounts); do mount -o remount,bind,ro "$m"; done
exec "$@"`
	cmd := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", os.Args[0], "-test.run=^TestCgroupsReadOnly$", "-test.v")
	cmd.Env = append(os.Environ(), "KILN_TEST_RO_CGROUP=1")
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("the read-only child: %v", err)
	}
}

func roCgroupChild(t *testing.T) {
	var logs syncBuffer
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatalf("kiln does not start with a read-only cgroup filesystem: %v", err)
	}
	if !strings.Contains(logs.String(), "rlimits only") {
		t.Errorf("kiln did not say boxes are bounded by rlimits only:\n%s", logs.String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := b.Check(ctx); err == nil || !strings.Contains(err.Error(), "cgroup") {
		t.Errorf("doctor's check: %v", err)
	}
	box, err := b.Create(ctx, sandbox.Spec{ID: "ro"})
	if err != nil {
		t.Fatalf("creating a box without cgroups: %v", err)
	}
	defer box.Close()
	res, err := box.RunShell(ctx, "echo ok", sandbox.ExecOptions{})
	if err != nil || res.Stdout.Text != "ok\n" {
		t.Errorf("a box without cgroups: %+v %v", res, err)
	}
	if _, err := box.RunShell(ctx, "f() { f | f & }; f", sandbox.ExecOptions{}); err != nil && !errors.Is(err, sandbox.ErrDied) {
		t.Logf("fork bomb under rlimits: %v", err)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
