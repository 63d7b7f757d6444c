package gvisor

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/sandbox/boxkit"
	"kiln/internal/sandbox/sandboxtest"
)

// deadServer is what a `kiln mcp --backend gvisor` process holds on the
// host, found from its state directory so that a test sees it after the
// process is gone.
type deadServer struct {
	pid   int
	state string // its state directory, /run/kiln-gvisor/<pid>.<start>-…
}

// findServerState waits for the state directory of kiln process pid.
func findServerState(t *testing.T, pid int) string {
	t.Helper()
	var dir string
	waitUntil(t, time.Minute, "the server's state directory", func() bool {
		for _, base := range []string{"/run/kiln-gvisor", filepath.Join(os.TempDir(), "kiln-gvisor")} {
			if m, _ := filepath.Glob(filepath.Join(base, strconv.Itoa(pid)+".*-*")); len(m) > 0 {
				dir = m[0]
				return true
			}
		}
		return false
	})
	return dir
}

// boxes lists the container IDs under the server's state directory.
func (d deadServer) boxes() []string {
	m, _ := filepath.Glob(filepath.Join(d.state, "boxes", "*"))
	var out []string
	for _, p := range m {
		out = append(out, filepath.Base(p))
	}
	return out
}

// cgroups lists the cgroups (relative paths) the server's boxes were put
// in, as their OCI specs name them, and those named with its owner stamp.
func (d deadServer) cgroups() []string {
	seen := map[string]bool{}
	m, _ := filepath.Glob(filepath.Join(d.state, "boxes", "*", "bundle", "config.json"))
	for _, p := range m {
		var s specs.Spec
		if b, err := os.ReadFile(p); err == nil && json.Unmarshal(b, &s) == nil && s.Linux != nil && s.Linux.CgroupsPath != "" {
			seen[s.Linux.CgroupsPath] = true
		}
	}
	for _, dir := range boxkit.HostCgroups().Dirs(CgroupParent) {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if e.IsDir() && strings.HasPrefix(e.Name(), strconv.Itoa(d.pid)+".") {
				seen[CgroupParent+"/"+e.Name()] = true
			}
		}
	}
	var out []string
	for c := range seen {
		out = append(out, c)
	}
	return out
}

// existingCgroups lists the directories of rels that exist in some
// hierarchy.
func existingCgroups(rels []string) []string {
	var out []string
	for _, rel := range rels {
		for _, d := range boxkit.HostCgroups().Dirs(rel) {
			if _, err := os.Stat(d); err == nil {
				out = append(out, d)
			}
		}
	}
	return out
}

// processes lists the host processes of the server's boxes: runsc, its
// gofer and sandbox (their command lines name the state directory) and
// whatever is in the boxes' cgroups (the sandbox's systrap stubs).
func (d deadServer) processes() []string {
	out := sandboxtest.Leftovers(d.state + "/")
	seen := map[int]bool{}
	for _, rel := range d.cgroups() {
		for _, pid := range boxkit.HostCgroups().Group(rel).Procs() {
			if !seen[pid] {
				seen[pid] = true
				cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
				out = append(out, fmt.Sprintf("%d (in %s): %s", pid, rel, strings.ReplaceAll(string(cmd), "\x00", " ")))
			}
		}
	}
	return out
}

// killAll is the test's own cleanup when the code under test failed.
func (d deadServer) killAll() {
	for _, rel := range d.cgroups() {
		boxkit.HostCgroups().Group(rel).Destroy()
	}
	out, _ := exec.Command("pgrep", "-f", d.state+"/").Output()
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) bool {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Errorf("gave up after %s waiting for %s", d, what)
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}

// startGvisorServer starts `kiln mcp --backend gvisor` with a pool of one
// box and no preloads, and waits until a call has run in a box.
func startGvisorServer(t *testing.T) (*sandboxtest.StdioServer, deadServer) {
	t.Helper()
	runsc := testRunsc(t)
	srv := sandboxtest.StartStdio(t, "--backend", "gvisor", "--runsc", runsc, "--pool", "1", "--preload", "")
	d := deadServer{pid: srv.Cmd.Process.Pid}
	d.state = findServerState(t, d.pid)
	t.Cleanup(d.killAll)
	return srv, d
}

// TestServerKilled kills `kiln mcp --backend gvisor` with SIGKILL while it
// holds boxes: their runsc, gofer and sandbox processes die with it, within
// seconds and without waiting for another kiln to start, even a box whose
// sandbox is stopped and so never notices that its stream closed. The next
// backend to start removes the cgroups and state the server left, whatever
// its own state directory.
func TestServerKilled(t *testing.T) {
	srv, d := startGvisorServer(t)
	srv.Initialize(t)
	srv.Send(t, `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"run_shell","arguments":{"command":"echo ready"}}}`)
	if m := srv.Await(t, "1", 3*time.Minute); !strings.Contains(string(m.Result), "ready") {
		t.Fatalf("the call: %s", m.Raw)
	}
	// The session's box and the pool's.
	waitUntil(t, time.Minute, "two boxes", func() bool { return len(d.boxes()) >= 2 })
	procs := d.processes()
	if len(procs) == 0 {
		t.Fatal("the server's boxes have no host process; the check is blind")
	}
	t.Logf("the server's boxes: %v; processes:\n%s", d.boxes(), strings.Join(procs, "\n"))
	// Wedge one box: stop the processes in its cgroup (its sandbox, gofer
	// and the sandbox's stubs). A stopped box does not see its agent's
	// stream close, so only the host can end it. runsc itself, outside the
	// cgroup, runs on as it would (stopped too, it would die of the SIGHUP
	// its orphaned process group gets when kiln dies); the other box is
	// left alone.
	// Pick a box whose sandbox and gofer are both up: the server may be
	// starting another box (the pool refilling) whose cgroup is still empty.
	var cid string
	var wedged []int
	waitUntil(t, time.Minute, "a started box", func() bool {
		for _, c := range d.boxes() {
			if strings.HasPrefix(c, "kiln-template-") {
				continue
			}
			pids := boxkit.HostCgroups().Group(boxCgroup(filepath.Join(d.state, "boxes", c))).Procs()
			if len(pids) >= 2 {
				cid, wedged = c, pids
				return true
			}
		}
		return false
	})
	for _, pid := range wedged {
		syscall.Kill(pid, syscall.SIGSTOP)
	}
	if len(wedged) < 2 {
		t.Fatalf("found %v to stop in box %s; want its gofer and sandbox at least", wedged, cid)
	}
	t.Logf("stopped %v of box %s", wedged, cid)
	srv.Cmd.Process.Kill()
	srv.Cmd.Wait()
	start := time.Now()
	if waitUntil(t, 30*time.Second, "the boxes to die with their server", func() bool { return len(d.processes()) == 0 }) {
		t.Logf("the boxes were gone %s after the server", time.Since(start).Round(time.Millisecond))
	} else {
		t.Errorf("outlived their server:\n%s", strings.Join(d.processes(), "\n"))
		d.killAll()
	}
	left := existingCgroups(d.cgroups())
	t.Logf("left by the killed server: cgroups %v, state %s", left, d.state)

	// A backend with a state directory of its own still collects them.
	newTestBackend(t, Options{Cold: true})
	if l := existingCgroups(d.cgroups()); len(l) > 0 {
		t.Errorf("cgroups of the dead server survive a new backend: %v", l)
	}
	// One with the same base collects its state directory too.
	newTestBackend(t, Options{Cold: true, StateDir: filepath.Dir(d.state)})
	if _, err := os.Stat(d.state); err == nil {
		t.Errorf("the dead server's state directory survives: %s", d.state)
	}
}

// TestServerKilledMidTemplate kills the server while it builds its
// warm-start template: the template box dies with it, and the next backend
// removes its cgroup (a leftover template cgroup used to fail every later
// test's leak check) and state, although the server, not yet reaped, is a
// zombie.
func TestServerKilledMidTemplate(t *testing.T) {
	_, d := startGvisorServer(t)
	var tmpl string
	waitUntil(t, 2*time.Minute, "the template box", func() bool {
		for _, cid := range d.boxes() {
			if strings.HasPrefix(cid, "kiln-template-") && len(existingCgroups(d.cgroups())) > 0 {
				tmpl = cid
				return true
			}
		}
		return false
	})
	if tmpl == "" {
		t.FailNow()
	}
	// Not reaped: a dead server that is still a zombie owns nothing.
	t.Logf("killing the server while it builds %s", tmpl)
	syscall.Kill(d.pid, syscall.SIGKILL)
	waitUntil(t, 30*time.Second, "the template box to die with its server", func() bool { return len(d.processes()) == 0 })
	cgs := d.cgroups()
	t.Logf("left by the killed server: cgroups %v", existingCgroups(cgs))
	newTestBackend(t, Options{Cold: true})
	if l := existingCgroups(cgs); len(l) > 0 {
		t.Errorf("cgroups of the dead server survive a new backend: %v", l)
	}
	newTestBackend(t, Options{Cold: true, StateDir: filepath.Dir(d.state)})
	if _, err := os.Stat(d.state); err == nil {
		t.Errorf("the dead server's state directory survives: %s", d.state)
	}
}

// TestSweepOrphanCgroups fabricates what dead kiln processes leave under
// kiln-gvisor: an empty template cgroup of an older kiln (no owner in its
// name) and a cgroup whose owner is dead with a process still in it. A new
// backend removes both, and leaves alone the cgroup of a live owner.
func TestSweepOrphanCgroups(t *testing.T) {
	testRunsc(t)
	dirs := boxkit.HostCgroups().Dirs(CgroupParent)
	if len(dirs) == 0 {
		t.Skip("no cgroup hierarchy mounted")
	}
	// A process that has exited: its stamp is an owner that is gone.
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	deadOwner := boxkit.Owner{PID: gone.Process.Pid, Start: 1}.String() // no process has it
	legacy := CgroupParent + "/kiln-template-0123456789abcdef-" + randSuffix()
	dead := CgroupParent + "/" + deadOwner + ".kiln-orphan-" + randSuffix()
	// pid 1 stands for another live kiln process.
	pid1, _ := boxkit.Stamp(1)
	live := CgroupParent + "/" + pid1.String() + ".kiln-live-" + randSuffix()
	for _, rel := range []string{legacy, dead, live} {
		for _, d := range boxkit.HostCgroups().Dirs(rel) {
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatalf("creating %s: %v", d, err)
			}
		}
		t.Cleanup(func() { boxkit.HostCgroups().Group(rel).Destroy() })
	}
	// A process left in the dead owner's cgroup.
	sleeper := exec.Command("sleep", "600")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	defer sleeper.Process.Kill()
	exited := make(chan struct{})
	go func() { sleeper.Wait(); close(exited) }()
	moved := 0
	for _, d := range boxkit.HostCgroups().Dirs(dead) {
		// Not into cpuset (v1), which takes no process before it has cpus.
		if os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(sleeper.Process.Pid)), 0) == nil {
			moved++
		}
	}
	if moved == 0 {
		t.Fatalf("could not move a process into %s", dead)
	}

	newTestBackend(t, Options{Cold: true})

	if l := existingCgroups([]string{legacy}); len(l) > 0 {
		t.Errorf("an empty cgroup of an older kiln survives: %v", l)
	}
	if l := existingCgroups([]string{dead}); len(l) > 0 {
		t.Errorf("the cgroup of a dead owner survives: %v", l)
	}
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Errorf("the process in a dead owner's cgroup survives")
	}
	if l := existingCgroups([]string{live}); len(l) != len(boxkit.HostCgroups().Dirs(live)) {
		t.Errorf("the cgroup of a live owner was removed: %v left of %v", l, boxkit.HostCgroups().Dirs(live))
	}
}
