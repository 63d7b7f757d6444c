package cluster_test

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/cluster"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

func TestMain(m *testing.M) {
	jail.MaybeInit()
	os.Exit(m.Run())
}

var (
	jailOnce sync.Once
	jailB    *jail.Backend
	jailErr  error
)

// localJail is one jail backend the test nodes share, as the boxes of two
// nodes on one host would share its kernel. Tests that need it skip where
// the jail does not run.
func localJail(t testing.TB) *jail.Backend {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("the cluster tests serve jail boxes, which need root here (the rootless jail is tested on the field host)")
	}
	agent := sandboxtest.BuildAgent(t)
	jailOnce.Do(func() { jailB, jailErr = jail.New(jail.Options{Agent: agent}) })
	if jailErr != nil {
		t.Fatal(jailErr)
	}
	return jailB
}

// certs writes a certificate directory for the test.
func certs(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "certs")
	if err := cluster.WriteCerts(dir, time.Hour); err != nil {
		t.Fatal(err)
	}
	return dir
}

// startNode serves a node on a loopback port and returns its address.
// With at, it listens there (retrying a while: another run may still
// hold the port).
func startNode(t testing.TB, dir string, o cluster.NodeOptions, at ...string) (string, *cluster.Node) {
	t.Helper()
	if o.Backend == nil {
		o.Backend = localJail(t)
	}
	if o.TLS == nil {
		cfg, err := cluster.NodeTLS(dir)
		if err != nil {
			t.Fatal(err)
		}
		o.TLS = cfg
	}
	if o.MaxBoxes == 0 {
		o.MaxBoxes = 8
	}
	n, err := cluster.NewNode(o)
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:0"
	if len(at) > 0 {
		addr = at[0]
	}
	ln, err := net.Listen("tcp", addr)
	for deadline := time.Now().Add(10 * time.Second); err != nil && len(at) > 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		ln, err = net.Listen("tcp", addr)
	}
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- n.Serve(ln) }()
	t.Cleanup(func() {
		n.Close()
		if err := <-done; err != nil {
			t.Errorf("node: %v", err)
		}
	})
	return ln.Addr().String(), n
}

func front(t testing.TB, dir string, nodes ...string) *cluster.Backend {
	t.Helper()
	cfg, err := cluster.FrontTLS(dir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := cluster.New(cluster.Options{Nodes: nodes, TLS: cfg})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestConformance runs the whole conformance suite, the hostile battery
// included, on boxes made by two nodes and reached through a front.
func TestConformance(t *testing.T) {
	dir := certs(t)
	a, _ := startNode(t, dir, cluster.NodeOptions{})
	b, _ := startNode(t, dir, cluster.NodeOptions{})
	sandboxtest.RunWith(t, leakChecked{front(t, dir, a, b), localJail(t)}, sandboxtest.Options{HostProcesses: true})
}

// leakChecked is a front whose leftovers are its nodes' jail's: a box the
// front closed must be gone from the node's host too.
type leakChecked struct {
	*cluster.Backend
	jail *jail.Backend
}

func (l leakChecked) Leftovers() []string { return l.jail.Leftovers() }

// TestAuth: a node serves only a front with a certificate of its CA made
// for client use, and a front talks only to a node with one made for
// server use. The control, the right front, is asked first.
func TestAuth(t *testing.T) {
	dir := certs(t)
	other := certs(t)
	addr, _ := startNode(t, dir, cluster.NodeOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if st, err := front(t, dir, addr).Status(ctx, addr); err != nil || st.Backend != "jail" {
		t.Fatalf("control: the right front's status: %+v, %v", st, err)
	}
	status := func(t *testing.T, cfg *tls.Config) error {
		b, err := cluster.New(cluster.Options{Nodes: []string{addr}, TLS: cfg, DialTimeout: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		_, err = b.Status(ctx, addr)
		return err
	}
	right, err := cluster.FrontTLS(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Run("no certificate", func(t *testing.T) {
		cfg := right.Clone()
		cfg.Certificates = nil
		if err := status(t, cfg); err == nil {
			t.Error("a front without a certificate got a status")
		}
	})
	t.Run("another CA's front", func(t *testing.T) {
		cfg, err := cluster.FrontTLS(other)
		if err != nil {
			t.Fatal(err)
		}
		cfg.RootCAs = right.RootCAs // it trusts the node; the node must not trust it
		if err := status(t, cfg); err == nil {
			t.Error("a front of another CA got a status")
		}
	})
	t.Run("a node's certificate as a front's", func(t *testing.T) {
		node, err := tls.LoadX509KeyPair(filepath.Join(dir, cluster.NodeCertFile), filepath.Join(dir, cluster.NodeKeyFile))
		if err != nil {
			t.Fatal(err)
		}
		cfg := right.Clone()
		cfg.Certificates = []tls.Certificate{node}
		if err := status(t, cfg); err == nil {
			t.Error("a node's certificate (made for server use) got a status as a front")
		}
	})
	t.Run("plain TCP", func(t *testing.T) {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		agentproto.WriteFrame(c, &cluster.Open{Op: cluster.OpStatus})
		var st cluster.Status
		if err := agentproto.ReadFrame(c, &st); err == nil {
			t.Errorf("a plain TCP client got a status: %+v", st)
		}
	})
	t.Run("a node of another CA", func(t *testing.T) {
		impostor, _ := startNode(t, other, cluster.NodeOptions{})
		b := front(t, dir, impostor)
		if _, err := b.Status(ctx, impostor); err == nil {
			t.Error("the front took a status from a node of another CA")
		}
		if box, err := b.Create(ctx, sandbox.Spec{ID: "impostor"}); err == nil {
			box.Close()
			t.Error("the front placed a box on a node of another CA")
		}
	})
	t.Run("a front's certificate as a node's", func(t *testing.T) {
		fr, err := tls.LoadX509KeyPair(filepath.Join(dir, cluster.FrontCertFile), filepath.Join(dir, cluster.FrontKeyFile))
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := cluster.NodeTLS(dir)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{fr}
		fake, _ := startNode(t, dir, cluster.NodeOptions{TLS: cfg})
		if _, err := front(t, dir, fake).Status(ctx, fake); err == nil {
			t.Error("the front took a status from a server with a front's certificate")
		}
	})
	// The node still serves the right front after all that.
	if _, err := front(t, dir, addr).Status(ctx, addr); err != nil {
		t.Errorf("after the refusals, the right front: %v", err)
	}
}

// TestHostileFront: frames a node refuses before any box is made, each
// followed by a front the node still serves.
func TestHostileFront(t *testing.T) {
	dir := certs(t)
	addr, n := startNode(t, dir, cluster.NodeOptions{HandshakeTimeout: 2 * time.Second})
	cfg, err := cluster.FrontTLS(dir)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	frame := func(body string) []byte {
		return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
	}
	for name, frame := range map[string][]byte{
		"not JSON":       frame("hello"),
		"unknown op":     frame(`{"op":"boom"}`),
		"no op":          frame(`{}`),
		"a box's frame":  frame(`{"id":1,"op":"shell","code":"id"}`),
		"over the bound": append(binary.BigEndian.AppendUint32(nil, 1<<20), '{'),
		"cut short":      frame(`{"op":"create"`)[:10],
	} {
		t.Run(name, func(t *testing.T) {
			c, err := tls.Dial("tcp", addr, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(20 * time.Second))
			c.Write(frame)
			var hello agentproto.Hello
			if err := agentproto.ReadFrame(c, &hello); err == nil {
				t.Errorf("the node answered %+v", hello)
			}
			if st, err := front(t, dir, addr).Status(ctx, addr); err != nil || st.Boxes != 0 {
				t.Errorf("after it, a status: %+v, %v", st, err)
			}
		})
	}
	if st := n.Status(); st.Boxes != 0 {
		t.Errorf("the node counts %d boxes", st.Boxes)
	}
}

// TestPlacement: boxes spread over the nodes by their free share, a full
// node is passed over, the cap holds, and a closed box frees its place.
func TestPlacement(t *testing.T) {
	dir := certs(t)
	a, na := startNode(t, dir, cluster.NodeOptions{MaxBoxes: 2})
	b, nb := startNode(t, dir, cluster.NodeOptions{MaxBoxes: 2})
	f := front(t, dir, a, b)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	on := map[string]int{}
	var boxes []sandbox.Sandbox
	defer func() {
		for _, box := range boxes {
			box.Close()
		}
	}()
	for i := range 4 {
		box, err := f.Create(ctx, sandbox.Spec{ID: "p"})
		if err != nil {
			t.Fatalf("box %d: %v", i, err)
		}
		boxes = append(boxes, box)
		on[cluster.NodeOf(box)]++
	}
	if on[a] != 2 || on[b] != 2 {
		t.Errorf("boxes by node: %v, want 2 on each", on)
	}
	if na.Status().Boxes != 2 || nb.Status().Boxes != 2 {
		t.Errorf("the nodes count %d and %d boxes, want 2 each", na.Status().Boxes, nb.Status().Boxes)
	}
	if box, err := f.Create(ctx, sandbox.Spec{ID: "over"}); err == nil {
		box.Close()
		t.Fatal("a fifth box was made on two nodes of 2")
	} else if !strings.Contains(err.Error(), "full") {
		t.Errorf("the fifth box's error does not say the nodes are full: %v", err)
	}
	// Each box runs on its node and answers through the front.
	for i, box := range boxes {
		if err := sandbox.Probe(ctx, box); err != nil {
			t.Errorf("box %d: %v", i, err)
		}
	}
	boxes[0].Close()
	freed := cluster.NodeOf(boxes[0])
	waitFor(t, func() bool { return na.Status().Boxes+nb.Status().Boxes == 3 })
	box, err := f.Create(ctx, sandbox.Spec{ID: "again"})
	if err != nil {
		t.Fatal(err)
	}
	boxes = append(boxes, box)
	if cluster.NodeOf(box) != freed {
		t.Errorf("the new box went to %s, not to %s where a place was freed", cluster.NodeOf(box), freed)
	}
}

// TestBoxCapAcrossFronts: the cluster's box cap is the sum of its nodes'
// --max-boxes, held at each node whatever front asks. Two fronts racing
// for six boxes on two nodes of 2 get four between them, and the other
// two are told the nodes are full.
func TestBoxCapAcrossFronts(t *testing.T) {
	dir := certs(t)
	a, na := startNode(t, dir, cluster.NodeOptions{MaxBoxes: 2})
	b, nb := startNode(t, dir, cluster.NodeOptions{MaxBoxes: 2})
	fronts := []*cluster.Backend{front(t, dir, a, b), front(t, dir, b, a)}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var mu sync.Mutex
	var made []sandbox.Sandbox
	var refused []error
	var wg sync.WaitGroup
	for i := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			box, err := fronts[i%2].Create(ctx, sandbox.Spec{ID: fmt.Sprintf("cap%d", i)})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				refused = append(refused, err)
				return
			}
			made = append(made, box)
		}()
	}
	wg.Wait()
	defer func() {
		for _, box := range made {
			box.Close()
		}
	}()
	if len(made) != 4 || na.Status().Boxes != 2 || nb.Status().Boxes != 2 {
		t.Fatalf("two fronts made %d boxes on two nodes of 2 (the nodes count %d and %d), want 4; refused: %v", len(made), na.Status().Boxes, nb.Status().Boxes, refused)
	}
	for _, err := range refused {
		if !strings.Contains(err.Error(), "full") {
			t.Errorf("a refused box's error does not say the nodes are full: %v", err)
		}
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestLimitsHeld: a node holds what a front asks within its own limits.
// The control asks for less than the node's ceiling and gets it.
func TestLimitsHeld(t *testing.T) {
	dir := certs(t)
	addr, _ := startNode(t, dir, cluster.NodeOptions{Limits: sandbox.Limits{OpenFiles: 512}})
	f := front(t, dir, addr)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nofile := func(asked int) string {
		box, err := f.Create(ctx, sandbox.Spec{ID: "limits", Limits: sandbox.Limits{OpenFiles: asked}})
		if err != nil {
			t.Fatal(err)
		}
		defer box.Close()
		res, err := box.RunPython(ctx, "import resource; resource.getrlimit(resource.RLIMIT_NOFILE)[1]", sandbox.ExecOptions{})
		if err != nil || res.Error != nil {
			t.Fatalf("%v %+v", err, res)
		}
		return res.Result["text/plain"]
	}
	if got := nofile(256); got != "256" {
		t.Fatalf("control: asked for 256 open files under a ceiling of 512, the box has %s", got)
	}
	if got := nofile(1 << 20); got != "512" {
		t.Errorf("asked for 1048576 open files under a ceiling of 512, the box has %s", got)
	}
}

// TestLiveOutput: a call's live output comes through the node.
func TestLiveOutput(t *testing.T) {
	dir := certs(t)
	addr, _ := startNode(t, dir, cluster.NodeOptions{})
	f := front(t, dir, addr)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := f.Create(ctx, sandbox.Spec{ID: "live"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	var mu sync.Mutex
	var seen []string
	lctx := sandbox.WithOutput(ctx, func(o agentproto.Output) {
		mu.Lock()
		seen = append(seen, o.Tail)
		mu.Unlock()
	})
	res, err := box.RunPython(lctx, "import time\nfor i in range(6):\n    print('tick', i, flush=True); time.sleep(0.25)", sandbox.ExecOptions{})
	if err != nil || res.Error != nil {
		t.Fatalf("%v %+v", err, res)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) == 0 || !strings.Contains(strings.Join(seen, ""), "tick") {
		t.Errorf("live output through the node: %q", seen)
	}
}

// TestNodeGoes: when a node goes, its boxes die at the front (the session
// layer replaces them), and the node's boxes are destroyed with it.
func TestNodeGoes(t *testing.T) {
	dir := certs(t)
	addr, n := startNode(t, dir, cluster.NodeOptions{})
	f := front(t, dir, addr)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := f.Create(ctx, sandbox.Spec{ID: "goes"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	running := make(chan error, 1)
	go func() {
		_, err := box.RunPython(ctx, "import time; time.sleep(60)", sandbox.ExecOptions{})
		running <- err
	}()
	time.Sleep(300 * time.Millisecond)
	n.Close()
	select {
	case <-box.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the front's box lives on after its node went")
	}
	if err := <-running; !errors.Is(err, sandbox.ErrDied) {
		t.Errorf("the running call ended with %v, want sandbox.ErrDied", err)
	}
	if st := n.Status(); st.Boxes != 0 {
		t.Errorf("the node that went still counts %d boxes", st.Boxes)
	}
}

// TestFrontGoes: a front closing its box destroys the box on the node.
func TestFrontGoes(t *testing.T) {
	dir := certs(t)
	addr, n := startNode(t, dir, cluster.NodeOptions{})
	f := front(t, dir, addr)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := f.Create(ctx, sandbox.Spec{ID: "front"})
	if err != nil {
		t.Fatal(err)
	}
	res, err := box.RunShell(ctx, "sleep 300 & echo started", sandbox.ExecOptions{})
	if err != nil || !strings.Contains(res.Stdout.Text, "started") {
		t.Fatalf("%v %+v", err, res)
	}
	if n.Status().Boxes != 1 {
		t.Fatalf("the node counts %d boxes, want 1", n.Status().Boxes)
	}
	box.Close()
	waitFor(t, func() bool { return n.Status().Boxes == 0 })
	if left := localJail(t).Leftovers(); len(left) > 0 {
		t.Errorf("the jail holds %v after the front closed its box", left)
	}
}

// TestBoxCannotReachNode: code in a node's box cannot connect to the node
// it runs on (it has no network), let alone speak to it as a front. The
// control: the host reaches the same address.
func TestBoxCannotReachNode(t *testing.T) {
	dir := certs(t)
	addr, _ := startNode(t, dir, cluster.NodeOptions{})
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("control: the host cannot reach the node at %s: %v", addr, err)
	}
	c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := front(t, dir, addr).Create(ctx, sandbox.Spec{ID: "reach"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	host, port, _ := net.SplitHostPort(addr)
	res, err := box.RunPython(ctx, fmt.Sprintf(`import socket
s = socket.socket()
s.settimeout(5)
try:
    s.connect((%q, %s))
    print("connected")
except OSError as e:
    print("refused:", e)`, host, port), sandbox.ExecOptions{})
	if err != nil || res.Error != nil {
		t.Fatalf("%v %+v", err, res)
	}
	if out := res.Stdout.Text; !strings.HasPrefix(out, "refused:") {
		t.Errorf("a box on the node reached it: %q", out)
	}
}

// TestLimitHitsThroughNode: the front learns from the node what a box's
// limits stopped, as the session layer needs to name the limit a call hit.
func TestLimitHitsThroughNode(t *testing.T) {
	dir := certs(t)
	addr, _ := startNode(t, dir, cluster.NodeOptions{Limits: sandbox.Limits{MemoryBytes: 128 << 20}})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	box, err := front(t, dir, addr).Create(ctx, sandbox.Spec{ID: "oom"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	r := box.(sandbox.LimitReporter)
	before := r.LimitHits()
	if before.OOMKills != 0 {
		t.Fatalf("control: a new box counts %d OOM kills (-1: the node's host does not count them)", before.OOMKills)
	}
	box.RunPython(ctx, "x = bytearray(512 << 20)", sandbox.ExecOptions{})
	if after := r.LimitHits(); after.OOMKills < 1 {
		t.Errorf("after a 512 MiB allocation under a 128 MiB limit, the front reads %d OOM kills", after.OOMKills)
	}
}

// TestStuckNode: a node that answers statuses but never answers a create
// (it takes the connection and hangs) holds a Create up no longer than the
// dial timeout, and the box goes to a node that answers. Without a
// deadline on the create's own dial, Create waited for ever.
func TestStuckNode(t *testing.T) {
	dir := certs(t)
	nodeCfg, err := cluster.NodeTLS(dir)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				var open cluster.Open
				if agentproto.ReadFrame(c, &open) != nil || open.Op != cluster.OpStatus {
					return // held open, never answered
				}
				agentproto.WriteFrame(c, &cluster.Status{Node: "stuck", Backend: "jail", MaxBoxes: 100})
				c.Close()
			}()
		}
	}()
	stuck := ln.Addr().String()
	good, _ := startNode(t, dir, cluster.NodeOptions{}) // 8 boxes: a smaller free share than the stuck one's
	cfg, err := cluster.FrontTLS(dir)
	if err != nil {
		t.Fatal(err)
	}
	f, err := cluster.New(cluster.Options{Nodes: []string{stuck, good}, TLS: cfg, DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := f.Status(context.Background(), stuck); err != nil || st.Node != "stuck" {
		t.Fatalf("control: the stuck node's status: %+v %v", st, err)
	}
	done := make(chan struct{})
	var box sandbox.Sandbox
	go func() {
		defer close(done)
		box, err = f.Create(context.Background(), sandbox.Spec{ID: "stuck"})
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Create is held up by a node that never answers")
	}
	if err != nil {
		t.Fatalf("with one node stuck and one serving: %v", err)
	}
	defer box.Close()
	if cluster.NodeOf(box) != good {
		t.Errorf("the box went to %s, not the serving node %s", cluster.NodeOf(box), good)
	}
}

// TestDiscover: a front of Discover places boxes on the nodes it lists,
// and when a listing fails (the API server away), on the last one.
func TestDiscover(t *testing.T) {
	dir := certs(t)
	a, _ := startNode(t, dir, cluster.NodeOptions{})
	cfg, err := cluster.FrontTLS(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cluster.New(cluster.Options{Nodes: []string{a}, Discover: func(context.Context) ([]string, error) { return nil, nil }, TLS: cfg}); err == nil {
		t.Error("a front took both --cluster-nodes and --cluster-discover")
	}
	var listings atomic.Int32
	var fail atomic.Bool
	f, err := cluster.New(cluster.Options{TLS: cfg, DiscoverEvery: time.Nanosecond, Discover: func(context.Context) ([]string, error) {
		listings.Add(1)
		if fail.Load() {
			return nil, errors.New("the API server is away")
		}
		return []string{a}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, away := range []bool{false, true} {
		fail.Store(away)
		before := listings.Load()
		box, err := f.Create(ctx, sandbox.Spec{ID: "found"})
		if err != nil {
			t.Fatalf("API server away %v: %v", away, err)
		}
		if at := cluster.NodeOf(box); at != a {
			t.Errorf("API server away %v: the box is on %q, not the listed %s", away, at, a)
		}
		box.Close()
		if listings.Load() == before {
			t.Errorf("API server away %v: the front did not list the nodes", away)
		}
	}
}

// logLines is a slog handler's output, safe for a test to read while a
// node writes it.
type logLines struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestPendingCapped: whoever reaches a node's port cannot hold it with
// handshakes it never finishes. Past --max-pending silent connections a
// new one is closed at once, the refusals are logged about once a second
// rather than each, and once the silent ones go a front is served again.
// The first status is the control: the node serves a front at all.
func TestPendingCapped(t *testing.T) {
	dir := certs(t)
	var logged logLines
	addr, _ := startNode(t, dir, cluster.NodeOptions{MaxPending: 4, HandshakeTimeout: time.Minute,
		Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	f := front(t, dir, addr)
	if _, err := f.Status(ctx, addr); err != nil {
		t.Fatalf("control: %v", err)
	}
	var silent []net.Conn
	defer func() {
		for _, c := range silent {
			c.Close()
		}
	}()
	for range 4 {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		silent = append(silent, c)
	}
	for i := range 20 {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
		var ne net.Error
		if err == nil || errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("connection %d past 4 silent ones was held open (read: %v)", i+5, err)
		}
	}
	if n := strings.Count(logged.String(), "refused connections"); n == 0 || n > 5 {
		t.Errorf("20 refusals were logged in %d lines, want a few:\n%s", n, logged.String())
	}
	for _, c := range silent {
		c.Close()
	}
	silent = nil
	for i := 0; ; i++ {
		if _, err := f.Status(ctx, addr); err == nil {
			break
		} else if i > 100 {
			t.Fatalf("once the silent connections went, the front is still refused: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
