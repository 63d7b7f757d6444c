package boxkit

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// The delegation tests run against a fake cgroup v2 filesystem laid out
// as systemd lays out a user's: the files are this test's user's, so they
// count as delegated, and their controllers are what each case writes.

// fakeDelegation makes root/<group> with controllers, and returns root.
func fakeDelegation(t *testing.T, group, controllers string) string {
	t.Helper()
	root := fakeCgroupfs(t, true)
	dir := filepath.Join(root, group)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "cgroup.controllers"), controllers)
	writeFile(t, filepath.Join(dir, "cgroup.subtree_control"), "")
	writeFile(t, filepath.Join(dir, "cgroup.procs"), "")
	return root
}

const userScope = "/user.slice/user-1000.slice/user@1000.service/app.slice/kiln.scope"

func TestFindDelegation(t *testing.T) {
	self := []byte("0::" + userScope + "\n")
	for _, tc := range []struct {
		name, controllers string
		self              []byte
		missing           []string
		reason            string // a word the error must hold
	}{
		{name: "delegated", controllers: "cpu memory pids\n", self: self},
		{name: "systemd's default: no cpu", controllers: "memory pids\n", self: self, missing: []string{"cpu"}},
		{name: "nothing delegated", controllers: "\n", self: self, missing: []string{"memory", "pids", "cpu"}},
		{name: "no v2 line", controllers: "cpu memory pids\n", self: []byte("1:name=systemd:/\n"), reason: "no 0:: line"},
		{name: "the root cgroup", controllers: "cpu memory pids\n", self: []byte("0::/\n"), reason: "root cgroup"},
		{name: "another group", controllers: "cpu memory pids\n", self: []byte("0::/system.slice/gone.service\n"), reason: "reading cgroup"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := fakeDelegation(t, userScope, tc.controllers)
			got, err := FindDelegation(root, tc.self, os.Getuid())
			if tc.missing == nil && tc.reason == "" {
				if err != nil || got != userScope {
					t.Fatalf("FindDelegation = %q, %v; want %q", got, err, userScope)
				}
				return
			}
			var de *DelegationError
			if !errors.As(err, &de) {
				t.Fatalf("FindDelegation = %q, %v; want a DelegationError", got, err)
			}
			if diff := cmp.Diff(tc.missing, de.Missing); diff != "" {
				t.Errorf("missing controllers (-want +got):\n%s", diff)
			}
			if !strings.Contains(err.Error(), tc.reason) || de.Hint == "" {
				t.Errorf("error %q: want %q and a hint", err, tc.reason)
			}
			if tc.missing != nil && !strings.Contains(err.Error(), "Delegate=") {
				t.Errorf("error %q does not say how to delegate", err)
			}
		})
	}
}

// A group that belongs to another uid (a login session's scope, root's) is
// not delegated, whatever its controllers.
func TestFindDelegationOwner(t *testing.T) {
	root := fakeDelegation(t, userScope, "cpu memory pids\n")
	_, err := FindDelegation(root, []byte("0::"+userScope+"\n"), os.Getuid()+1)
	if err == nil || !strings.Contains(err.Error(), "not delegated to uid") || !strings.Contains(err.Error(), "systemd-run --user") {
		t.Errorf("FindDelegation of a group someone else owns: %v", err)
	}
}

// Delegate moves the group's processes into the leaf before it enables
// controllers (the no-internal-process rule), and roots kiln's groups there.
func TestDelegate(t *testing.T) {
	root := fakeDelegation(t, userScope, "cpu memory pids\n")
	dir := filepath.Join(root, userScope)
	// A fake cgroup.procs is a plain file: a write replaces it instead of
	// moving the process out. The test reads the leaf's to see the moves.
	writeFile(t, filepath.Join(dir, "cgroup.procs"), "")
	c, err := Delegate(root, userScope)
	if err != nil {
		t.Fatal(err)
	}
	if c.Root() != dir || !c.V2() {
		t.Errorf("delegated filesystem at %s (v2 %v), want %s", c.Root(), c.V2(), dir)
	}
	if got := readFiles(t, dir, "cgroup.subtree_control")["cgroup.subtree_control"]; got != cgroupV2Controllers {
		t.Errorf("subtree_control = %q, want %q", got, cgroupV2Controllers)
	}
	if _, err := os.Stat(filepath.Join(dir, DelegateLeaf)); err != nil {
		t.Errorf("no leaf: %v", err)
	}
	// kiln's groups go under the delegated group, never at the host root.
	g, err := c.CreateParent("kiln/42")
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{filepath.Join(dir, "kiln/42")}, g.Dirs()); diff != "" {
		t.Errorf("server group dirs (-want +got):\n%s", diff)
	}
	if _, err := os.Stat(filepath.Join(root, "kiln")); err == nil {
		t.Errorf("a group was made at the host's root")
	}
	box, err := c.Create("kiln/42/box", CgroupLimits{MemoryBytes: 256 << 20, Pids: 64, CPUs: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"memory.max": "268435456", "pids.max": "64", "cpu.max": "50000 100000"}
	if diff := cmp.Diff(want, readFiles(t, box.Dirs()[0], "memory.max", "pids.max", "cpu.max")); diff != "" {
		t.Errorf("box limits (-want +got):\n%s", diff)
	}
}

// Delegate moves each process listed in the group into the leaf, and
// says which stay (a fake group keeps its list: the kernel's would empty).
func TestDelegateMovesProcesses(t *testing.T) {
	root := fakeDelegation(t, userScope, "cpu memory pids\n")
	dir := filepath.Join(root, userScope)
	sleeper := exec.Command("sleep", "60")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { sleeper.Process.Kill(); sleeper.Wait() }()
	pid := strconv.Itoa(sleeper.Process.Pid)
	writeFile(t, filepath.Join(dir, "cgroup.procs"), pid+"\n")
	_, err := Delegate(root, userScope)
	if err == nil || !strings.Contains(err.Error(), "["+pid+"] are still in") {
		t.Errorf("Delegate with a process that never leaves: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, DelegateLeaf, "cgroup.procs")); string(b) != pid {
		t.Errorf("leaf cgroup.procs = %q, want %s", b, pid)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control")); len(b) != 0 {
		t.Errorf("controllers enabled while a process is in the group: %q", b)
	}
}
