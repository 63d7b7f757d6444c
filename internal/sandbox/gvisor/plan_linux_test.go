package gvisor

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/google/go-cmp/cmp"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
)

// TestEtcFromPlan builds a host-runtime box root for the jail's user and
// sees the same synthesized /etc a jail box gets (boxpolicy.Etc, which the
// jail's init writes; TestDirectAndZygotePlansAgree reads it back from
// inside a jail box).
func TestEtcFromPlan(t *testing.T) {
	dir := t.TempDir()
	if err := buildHostRoot(dir, boxpolicy.UID, boxpolicy.GID); err != nil {
		t.Fatal(err)
	}
	for name, want := range boxpolicy.Etc(boxpolicy.Hostname, "", boxpolicy.UID, boxpolicy.GID) {
		got, err := os.ReadFile(filepath.Join(dir, "etc", name))
		if err != nil {
			t.Errorf("reading /etc/%s: %v", name, err)
			continue
		}
		if diff := cmp.Diff(want, string(got)); diff != "" {
			t.Errorf("/etc/%s differs from the jail's (-jail +gvisor):\n%s", name, diff)
		}
	}
}

// TestSpecFromPlan: a box's OCI spec carries the box plan the jail
// interprets: its environment, rlimits, workspace, tmpfs sizes and masks.
func TestSpecFromPlan(t *testing.T) {
	l := sandbox.Limits{WorkspaceBytes: 24 << 20, TmpBytes: 40 << 20, Inodes: 3000, Pids: 77, OpenFiles: 333}.WithDefaults()
	s := buildSpec(boxConfig{Root: "/r", Agent: "/a", Limits: l, UID: boxpolicy.UID, GID: boxpolicy.GID})
	plan := boxpolicy.New(boxpolicy.Limits{WorkspaceBytes: l.WorkspaceBytes, TmpBytes: l.TmpBytes, Inodes: l.Inodes, Pids: l.Pids, OpenFiles: l.OpenFiles}, boxpolicy.UID, boxpolicy.GID)
	if diff := cmp.Diff(append(slices.Clone(plan.Env), boxpolicy.UserEnv(boxpolicy.UID)...), s.Process.Env); diff != "" {
		t.Errorf("environment (-plan +spec):\n%s", diff)
	}
	var rl []boxpolicy.Rlimit
	for _, r := range s.Process.Rlimits {
		if r.Soft != r.Hard {
			t.Errorf("%s: soft %d, hard %d", r.Type, r.Soft, r.Hard)
		}
		rl = append(rl, boxpolicy.Rlimit{Name: r.Type, Value: r.Hard})
	}
	if diff := cmp.Diff(plan.Rlimits, rl); diff != "" {
		t.Errorf("rlimits (-plan +spec):\n%s", diff)
	}
	if s.Process.Cwd != plan.Workspace || s.Hostname != plan.Hostname {
		t.Errorf("cwd %q, hostname %q", s.Process.Cwd, s.Hostname)
	}
	mounts := map[string][]string{}
	for _, m := range s.Mounts {
		mounts[m.Destination] = m.Options
	}
	for _, tm := range plan.Tmpfs {
		if !slices.Contains(mounts[tm.Path], "size="+strconv.FormatInt(tm.Size, 10)) || !slices.Contains(mounts[tm.Path], "mode="+tm.Mode) {
			t.Errorf("%s: %q, want the plan's %+v", tm.Path, mounts[tm.Path], tm)
		}
	}
	for _, m := range plan.ProcMasks {
		if !slices.Contains(s.Linux.MaskedPaths, "/proc/"+m) {
			t.Errorf("/proc/%s is not masked: %q", m, s.Linux.MaskedPaths)
		}
	}
}
