package jail_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
)

// TestRootlessBoxUIDs: as an ordinary user with subordinate ids, code in
// a box runs as a host uid that is not the user's, and two boxes' code
// runs as two different ones.
func TestRootlessBoxUIDs(t *testing.T) {
	if os.Getuid() == 0 {
		t.Skip("a rootless case: run it as an ordinary user with subordinate ids (TestRootlessAsUser does)")
	}
	b := newBackend(t)
	ctx := context.Background()
	var hosts []string
	for _, id := range []string{"uid-a", "uid-b"} {
		box, err := b.Create(ctx, sandbox.Spec{ID: id})
		if err != nil {
			t.Fatal(err)
		}
		defer box.Close()
		// uid_map lines: inside, outside, count. Find the code's own.
		res, err := box.RunShell(ctx, `u=$(id -u); awk -v u="$u" '$1 <= u && u < $1 + $3 { print u - $1 + $2 }' /proc/self/uid_map`, sandbox.ExecOptions{})
		if err != nil {
			t.Fatal(err)
		}
		host := strings.TrimSpace(res.Stdout.Text)
		if host == "" || host == strconv.Itoa(os.Getuid()) {
			t.Errorf("box %s: code runs as host uid %q, want a subordinate uid of uid %d (stderr %q)", id, host, os.Getuid(), res.Stderr.Text)
		}
		hosts = append(hosts, host)
	}
	t.Logf("code of the two boxes runs as host uids %v", hosts)
	if hosts[0] == hosts[1] {
		t.Errorf("two boxes' code runs as one host uid, %s", hosts[0])
	}
}

// TestRootlessAsUser runs this package's conformance suite again as the
// ordinary user KILN_ROOTLESS_USER names (one with /etc/subuid and
// /etc/subgid ranges; under systemd, with cgroup delegation), the way a
// user's MCP client starts kiln. It needs root to become that user;
// where it runs as that user already, TestConformance is the entry point.
func TestRootlessAsUser(t *testing.T) {
	name := os.Getenv("KILN_ROOTLESS_USER")
	if name == "" {
		t.Skip("set KILN_ROOTLESS_USER to an ordinary user with subordinate id ranges to run the suite rootless")
	}
	if os.Getuid() != 0 {
		t.Skip("becoming KILN_ROOTLESS_USER needs root (as that user, run TestConformance itself)")
	}
	u, err := user.Lookup(name)
	if err != nil {
		t.Fatalf("KILN_ROOTLESS_USER: %v", err)
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("needs setpriv (util-linux) to become the user")
	}
	// The user may reach neither this test binary's directory nor the
	// module cache: hand it copies in a directory of its own.
	dir, err := os.MkdirTemp("", "kiln-rootless-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "jail.test")
	agent := filepath.Join(dir, "kiln-agent")
	for src, dst := range map[string]string{os.Args[0]: bin, sandboxtest.BuildAgent(t): agent} {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(setpriv, "--reuid", u.Uid, "--regid", u.Gid, "--init-groups",
		"env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", "HOME="+u.HomeDir, sandboxtest.PrebuiltEnv+"="+dir,
		bin, "-test.run", "^TestConformance$", "-test.v", fmt.Sprintf("-test.timeout=%s", "30m"))
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	t.Logf("as %s:\n%s", name, out)
	if err != nil {
		t.Fatalf("the conformance suite as %s: %v", name, err)
	}
	// A premise the user lacks skips the suite there: it did not pass.
	if i := bytes.Index(out, []byte("--- SKIP: TestConformance ")); i >= 0 {
		t.Skipf("the conformance suite skipped as %s: %s", name, bytes.TrimSpace(out[i:]))
	}
	if !bytes.Contains(out, []byte("--- PASS: TestConformance ")) {
		t.Fatalf("the conformance suite as %s did not say it passed", name)
	}
}
