package kubernetes

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox/sandboxtest"
)

// TestTwoServeReplicas runs two kiln servers on the cluster (stdio, so both
// serve the principal "local"): a session made through the first continues
// through the second after the first is killed mid-session, with its
// kernel's state (the Pod is the same).
func TestTwoServeReplicas(t *testing.T) {
	c := needCluster(t)
	ns := c.namespace(t)
	args := func(replica string) []string {
		a := []string{"--backend=kubernetes", "--k8s-image=" + c.image, "--k8s-namespace=" + ns,
			"--k8s-kubeconfig=" + os.Getenv("KUBECONFIG"), "--k8s-replica=" + replica}
		if c.seccomp != "" {
			a = append(a, "--k8s-seccomp-profile="+c.seccomp)
		}
		return a
	}
	call := func(s *sandboxtest.StdioServer, id int, code string) string {
		t.Helper()
		s.Send(t, fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"run_python","arguments":{"code":%q,"session":"analysis"}}}`, id, code))
		m := s.Await(t, fmt.Sprint(id), 5*time.Minute)
		if m.Error != nil {
			t.Fatalf("%s: %+v", code, m.Error)
		}
		return string(m.Result)
	}
	one := sandboxtest.StartStdio(t, args("one")...)
	one.Initialize(t)
	call(one, 1, "x = 41")
	two := sandboxtest.StartStdio(t, args("two")...)
	two.Initialize(t)
	one.Cmd.Process.Kill() // mid-session: its Lease and its attach are left behind
	if got := call(two, 2, "x + 1"); !strings.Contains(got, `42`) || strings.Contains(got, "NameError") {
		t.Fatalf("the session on the second replica: %s\nstderr:\n%s", got, two.Stderr)
	}
}
