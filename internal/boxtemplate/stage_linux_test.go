package boxtemplate

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestStageClosedToOtherUsers: while a setup runs, a local user who
// learns the stage's host path (every box's mountinfo prints it) cannot
// plant a file in it: only the user the setup's box runs as, once the
// backend hands the directory to it (HandTo), may write there.
func TestStageClosedToOtherUsers(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root: the test plants files as another host user")
	}
	dir := filepath.Join(t.TempDir(), "templates")
	for d := filepath.Dir(dir); d != "/tmp" && d != "/"; d = filepath.Dir(d) {
		os.Chmod(d, 0o755)
	}
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	st, err := s.Stage("t")
	if err != nil {
		t.Fatal(err)
	}
	defer st.Abort()
	plant := func(uid int) error {
		cmd := exec.Command("/bin/sh", "-c", `mkdir -p "$1/python" && echo 'import os' > "$1/python/sitecustomize.py"`, "sh", st.Files())
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid), NoSetGroups: true}}
		out, err := cmd.CombinedOutput()
		if err != nil {
			return &exec.ExitError{ProcessState: cmd.ProcessState, Stderr: out}
		}
		return nil
	}
	// The control: a user can plant where the path is open to them.
	open := filepath.Join(t.TempDir(), "open")
	os.Mkdir(open, 0o777)
	os.Chmod(open, 0o777)
	ctl := exec.Command("/bin/sh", "-c", `echo x > "$1/f"`, "sh", open)
	ctl.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 4243, Gid: 4243, NoSetGroups: true}}
	if out, err := ctl.CombinedOutput(); err != nil {
		t.Skipf("the control failed: another user cannot write even an open directory here (%v: %s)", err, out)
	}
	if err := plant(4243); err == nil {
		t.Fatalf("another local user planted python/sitecustomize.py in the stage %s", st.Files())
	}
	const boxUser = 4244
	if err := HandTo(st.Files(), boxUser, boxUser); err != nil {
		t.Fatal(err)
	}
	if err := plant(4243); err == nil {
		t.Errorf("another local user planted a file after the stage was handed to the box's user")
	}
	if err := plant(boxUser); err != nil {
		t.Errorf("the box's user cannot write its stage: %v", err)
	}
}

// TestSealDoesNotFollowASwap: an entry swapped for a symbolic link to a
// host file between seal's look at it and its change is never followed:
// the host file keeps its owner and mode.
func TestSealDoesNotFollowASwap(t *testing.T) {
	root := t.TempDir()
	victim := filepath.Join(t.TempDir(), "victim")
	os.WriteFile(victim, []byte("secret"), 0o600)
	os.WriteFile(filepath.Join(root, "a"), []byte("x"), 0o666)
	afterStat = func(p string) {
		if filepath.Base(p) == "a" {
			os.Remove(p)
			os.Symlink(victim, p)
		}
	}
	defer func() { afterStat = nil }()
	_, _, err := seal(root)
	fi, serr := os.Stat(victim)
	if serr != nil {
		t.Fatal(serr)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("seal followed a symbolic link swapped in: the host file is now %v (seal: %v)", fi.Mode().Perm(), err)
	}
	if err == nil || !strings.Contains(err.Error(), "a") {
		t.Errorf("seal of a tree that changed under it: %v, want a refusal naming the entry", err)
	}
}
