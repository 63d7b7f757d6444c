package cluster_test

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/cluster"
	"kiln/internal/session"
	"kiln/internal/sharedsaves"
	"kiln/internal/sharedsaves/s3test"
)

// TestHostLost: a box tells its node's loss (the node gone, or another run
// of it at the address) from its own death on a node still there.
func TestHostLost(t *testing.T) {
	dir := certs(t)
	addr, n := startNode(t, dir, cluster.NodeOptions{})
	f := front(t, dir, addr)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	mk := func() sandbox.Sandbox {
		box, err := f.Create(ctx, sandbox.Spec{ID: "lost"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { box.Close() })
		return box
	}
	lost := func(box sandbox.Sandbox) string { return box.(sandbox.HostLossReporter).HostLost() }

	// Control: a box killed on the host dies on a node still there.
	died := mk()
	killBoxes(t)
	waitFor(t, func() bool { return !alive(died) })
	if why := lost(died); why != "" {
		t.Fatalf("control: a box that died on a live node says its node was lost: %s", why)
	}
	live := mk()
	if why := lost(live); why != "" {
		t.Errorf("a live box says its node was lost: %s", why)
	}
	n.Close()
	waitFor(t, func() bool { return !alive(live) })
	if why := lost(live); !strings.Contains(why, "was lost") {
		t.Errorf("a box whose node went says %q", why)
	}
	// Another run of the node at the same address.
	addr2, n2 := startNodeAt(t, dir, addr)
	if addr2 != addr {
		t.Fatalf("the second run listens at %s, not %s", addr2, addr)
	}
	box := mk()
	n2.Close()
	startNodeAt(t, dir, addr)
	waitFor(t, func() bool { return !alive(box) })
	if why := lost(box); !strings.Contains(why, "restarted") {
		t.Errorf("a box whose node restarted says %q", why)
	}
}

// killBoxes kills the processes of every box of the nodes' jail from the
// host, as the host's OOM killer or its operator would: the boxes die on
// nodes that are still there.
func killBoxes(t *testing.T) {
	n := 0
	for _, l := range localJail(t).Leftovers() {
		var pid int
		if _, err := fmt.Sscanf(l, "process %d:", &pid); err == nil {
			syscall.Kill(pid, syscall.SIGKILL)
			n++
		}
	}
	if n == 0 {
		t.Error("no box process to kill")
	}
}

func alive(box sandbox.Sandbox) bool {
	select {
	case <-box.Done():
		return false
	default:
		return true
	}
}

// startNodeAt serves a node at addr, retrying while the port is held.
func startNodeAt(t *testing.T, dir, addr string) (string, *cluster.Node) {
	t.Helper()
	return startNode(t, dir, cluster.NodeOptions{}, addr)
}

// TestSessionSurvivesNode: a session whose node is lost resumes on another
// from its last checkpoint, saying so, whether the node went between calls
// or during one; a session whose box dies of itself on a node still there
// starts afresh, its saves forgotten (the control).
func TestSessionSurvivesNode(t *testing.T) {
	// scenario runs a session on two nodes with checkpoints after every
	// call: x = 42 is saved, then loss(the node holding the box) happens
	// while code runs, or after it with between; it returns that call's
	// outcome and the next's.
	scenario := func(t *testing.T, code string, between bool, loss func(n *cluster.Node) error) (during, after *session.Outcome) {
		dir := certs(t)
		a, na := startNode(t, dir, cluster.NodeOptions{})
		b, nb := startNode(t, dir, cluster.NodeOptions{})
		mgr := session.NewManager(session.Options{
			Backend:   front(t, dir, a, b),
			Hibernate: session.HibernateOptions{Dir: t.TempDir(), CheckpointEvery: time.Nanosecond},
		})
		defer mgr.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		run := func(code string) *session.Outcome {
			t.Helper()
			return runIn(ctx, t, mgr, "local", "s", code)
		}
		run("x = 6")
		run("x = x * 7") // the first call set the mark; this one is saved
		waitFor(t, func() bool {
			for _, si := range mgr.SessionList("local") {
				if si.Name == "s" && !si.Saved.IsZero() && !si.Unsaved {
					return true
				}
			}
			return false
		})
		on := holder(t, na, nb)
		if between {
			during = run(code)
			loss(on)
			time.Sleep(500 * time.Millisecond) // the front sees the connection end
		} else {
			go func() {
				time.Sleep(500 * time.Millisecond)
				loss(on)
			}()
			during = run(code)
		}
		after = run("globals().get('x')")
		return during, after
	}
	t.Run("control: the box is killed on its node", func(t *testing.T) {
		during, after := scenario(t, "import time; time.sleep(30)", false, func(*cluster.Node) error { killBoxes(t); return nil })
		if !during.Restarted || strings.Contains(during.Note, "was lost") {
			t.Errorf("the call whose box was killed: %+v %q", during.ExecResult, during.Note)
		}
		if after.Result["text/plain"] == "42" || strings.Contains(after.Note, "resumed") {
			t.Errorf("a box killed on a node still there resumed: %+v %q", after.ExecResult, after.Note)
		}
	})
	t.Run("the node goes between calls", func(t *testing.T) {
		_, after := scenario(t, "x", true, (*cluster.Node).Close)
		if after.Result["text/plain"] != "42" || !strings.Contains(after.Note, "was lost") || !strings.Contains(after.Note, "resumed this session from its last save") {
			t.Errorf("after its node went between calls: %+v %q", after.ExecResult, after.Note)
		}
		t.Logf("the note: %s", after.Note)
	})
	t.Run("the node goes during a call", func(t *testing.T) {
		during, after := scenario(t, "import time; time.sleep(30)", false, (*cluster.Node).Close)
		if !during.Restarted || !strings.Contains(during.Note, "was lost") || !strings.Contains(during.Note, "resumes this session from its last save") {
			t.Errorf("a call whose node went: %+v %q", during.ExecResult, during.Note)
		}
		if after.Result["text/plain"] != "42" || !strings.Contains(after.Note, "resumed this session from its last save") {
			t.Errorf("the call after: %+v %q", after.ExecResult, after.Note)
		}
		t.Logf("the notes: %s | %s", during.Note, after.Note)
	})
}

// TestSessionSurvivesNodeAndFront: a node and the front that placed a
// session there, lost together, take nothing the session saved when the
// fronts share a bucket (--saves-bucket): the next front its client
// reaches, with a state directory of its own and empty, resumes the
// session on another node from its last save. The control, a front with
// neither the first front's disk nor the bucket, starts it afresh.
func TestSessionSurvivesNodeAndFront(t *testing.T) {
	srv := s3test.Start(t)
	bucket := func() session.SharedSaves {
		b, err := sharedsaves.Open(context.Background(), sharedsaves.Options{Bucket: "s3://" + srv.Bucket + "/saves", Endpoint: srv.Endpoint})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	dir := certs(t)
	a, na := startNode(t, dir, cluster.NodeOptions{})
	b, nb := startNode(t, dir, cluster.NodeOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	first := session.NewManager(session.Options{
		Backend:   front(t, dir, a, b),
		Hibernate: session.HibernateOptions{Dir: t.TempDir(), CheckpointEvery: time.Nanosecond, Shared: bucket()},
	})
	// first is lost with the node: nothing of it is used after that, and
	// it is closed only once the test is over.
	t.Cleanup(first.Close)
	runIn(ctx, t, first, "alice", "s", "x = 6")
	runIn(ctx, t, first, "alice", "s", "x = x * 7") // the first call set the mark; this one is saved
	waitFor(t, func() bool {
		for o := range srv.Client(t).ListObjects(ctx, srv.Bucket, minio.ListObjectsOptions{Prefix: "saves/"}) {
			if o.Err == nil {
				return true
			}
		}
		return false
	})
	holder(t, na, nb).Close()

	control := session.NewManager(session.Options{
		Backend:   front(t, dir, a, b),
		Hibernate: session.HibernateOptions{Dir: t.TempDir(), CheckpointEvery: -1},
	})
	defer control.Close()
	if out := runIn(ctx, t, control, "alice", "s", "globals().get('x')"); out.Result["text/plain"] == "42" {
		t.Fatalf("the control, without the bucket, found the session: %+v", out.ExecResult)
	}
	// Its fresh box, bound to the session on the node left, would be
	// adopted by the next front: the newest state there is.
	control.Reset("alice", "s")

	second := session.NewManager(session.Options{
		Backend:   front(t, dir, a, b),
		Hibernate: session.HibernateOptions{Dir: t.TempDir(), CheckpointEvery: -1, Shared: bucket()},
	})
	defer second.Close()
	out := runIn(ctx, t, second, "alice", "s", "x")
	if out.Result["text/plain"] != "42" || !strings.Contains(out.Note, "resumed this session from its last save in shared storage") {
		t.Fatalf("after its node and its front went: %+v %q", out.ExecResult, out.Note)
	}
	t.Logf("the note: %s", out.Note)
	if n := na.Status().Boxes + nb.Status().Boxes; n < 1 {
		t.Errorf("the resumed session has no box on the node left")
	}
}

// holder is the one of two nodes that holds the one box between them.
func holder(t *testing.T, na, nb *cluster.Node) *cluster.Node {
	t.Helper()
	switch {
	case na.Status().Boxes == 1 && nb.Status().Boxes == 0:
		return na
	case nb.Status().Boxes == 1 && na.Status().Boxes == 0:
		return nb
	}
	t.Fatalf("boxes by node: %d and %d, want one box", na.Status().Boxes, nb.Status().Boxes)
	return nil
}
