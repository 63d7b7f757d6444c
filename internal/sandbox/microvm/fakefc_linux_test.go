package microvm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"kiln/internal/agentproto"
	"kiln/internal/egress"
	"kiln/internal/guestinit"
	"kiln/internal/image"
	"kiln/internal/sandbox"
)

// TestMain lets the test binary play Firecracker: the driver under test
// starts it as its "firecracker" binary (see TestFirecrackerBackend); and
// QEMU's jail init.
func TestMain(m *testing.M) {
	MaybeInit() // QEMU's jail init, when re-executed as one
	if os.Getenv("KILN_FAKE_FIRECRACKER") == "1" {
		os.Exit(runFakeFirecracker(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// runFakeFirecracker serves the API (spec-checked, as fakeFirecracker) on
// --api-sock, and plays the guest behind the vsock socket: its agent says
// hello after a boot, but not after a snapshot restore (the driver replays
// the template's hello), and answers python requests (see fakeGuest.run);
// guestinit's seed port takes seed messages.
func runFakeFirecracker(args []string) int {
	var apiSock string
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "--api-sock" {
			apiSock = args[i+1]
		}
	}
	l, err := net.Listen("unix", apiSock)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	bad := false
	f := &fakeFirecracker{state: "Not started", errorf: func(format string, a ...any) {
		bad = true
		fmt.Fprintf(os.Stderr, format+"\n", a...)
	}}
	var udsPath string
	g := newFakeGuest()
	f.hook = func(op string, body map[string]any) error {
		switch op {
		case "PUT /boot-source":
			// As kiln-agent's guestinit: the box plan on the kernel
			// command line, which an image older than the plan ignores.
			if p := guestinit.ParseCmdline(body["boot_args"].(string)).Plan; p != nil && os.Getenv("KILN_FAKE_OLD_GUEST") != "1" {
				g.plan = p.Digest()
				g.planNet = p.Network != nil
			}
		case "PUT /network-interfaces/{iface_id}":
			// As Firecracker: it opens the tap by name in its own
			// network namespace, now.
			name := body["host_dev_name"].(string)
			if _, err := net.InterfaceByName(name); err != nil {
				return fmt.Errorf("opening tap %s: %w", name, err)
			}
			g.tap = name
		case "PUT /vsock":
			udsPath = body["uds_path"].(string)
		case "PUT /actions":
			return g.serve(udsPath, true)
		case "PUT /snapshot/create":
			// The memory carries the guest's random state, as a real
			// snapshot does.
			if err := os.WriteFile(body["mem_file_path"].(string), g.save(), 0o600); err != nil {
				return err
			}
			// The device state names the NIC's tap.
			if err := os.WriteFile(body["snapshot_path"].(string), []byte(g.tap), 0o600); err != nil {
				return err
			}
		case "PUT /snapshot/load":
			tap, err := os.ReadFile(body["snapshot_path"].(string))
			if err != nil {
				return err
			}
			// The snapshot's NIC reopens its tap by name.
			if g.tap = string(tap); g.tap != "" {
				if _, err := net.InterfaceByName(g.tap); err != nil {
					return fmt.Errorf("restoring network device: opening tap %s: %w", g.tap, err)
				}
			}
			mem, err := os.ReadFile(body["mem_backend"].(map[string]any)["backend_path"].(string))
			if err != nil {
				return err
			}
			g.load(mem)
			return g.serve(body["vsock_override"].(map[string]any)["uds_path"].(string), false)
		}
		return nil
	}
	http.Serve(l, f)
	if bad {
		return 2
	}
	return 0
}

// Code the fake guest's agent answers with its random state: what
// Python's random module and the guest kernel's RNG would draw next.
const (
	fakeDrawPython = "import random; print(random.getrandbits(64))"
	fakeDrawKernel = "import os; print(os.urandom(8).hex())"
	// fakeNetwork answers the guest's NIC's tap and the address its
	// seed gave it.
	fakeNetwork = "print(network)"
)

// fakeGuest is the state a snapshot carries: Python's random state and
// the kernel's, both drawn at boot. Running sandbox.ReseedCell reseeds the
// first, a seed message on guestinit's seed port the second.
type fakeGuest struct {
	mu     sync.Mutex
	python string
	kernel string
	plan   string // the digest of the box plan it was booted with

	planNet bool       // the plan has a network
	tap     string     // the host device of its NIC; "": none
	addr    netip.Addr // what its seed said
}

func newFakeGuest() *fakeGuest { return &fakeGuest{python: rand.Text(), kernel: rand.Text()} }

func (g *fakeGuest) save() []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	return []byte(fmt.Sprintf("%s %s %v", g.python, g.kernel, g.planNet))
}

func (g *fakeGuest) load(mem []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	f := strings.Fields(string(mem))
	g.python, g.kernel, g.planNet = f[0], f[1], f[2] == "true" // its box plan is in its memory too
}

// run answers a python request.
func (g *fakeGuest) run(code string) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch code {
	case sandbox.ReseedCell:
		g.python = rand.Text()
		return ""
	case fakeDrawPython:
		return g.python + "\n"
	case fakeDrawKernel:
		return g.kernel + "\n"
	case fakeNetwork:
		return fmt.Sprintf("%s %v\n", g.tap, g.addr)
	}
	return "4\n"
}

func (g *fakeGuest) serve(uds string, hello bool) error {
	l, err := net.Listen("unix", uds)
	if err != nil {
		return err
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 32)
				n, _ := c.Read(buf)
				switch string(buf[:n]) {
				case fmt.Sprintf("CONNECT %d\n", agentVsockPort):
				case fmt.Sprintf("CONNECT %d\n", guestinit.SeedVsockPort):
					c.Write([]byte("OK 98\n"))
					g.serveSeed(c)
					return
				default:
					return
				}
				c.Write([]byte("OK 99\n"))
				if hello {
					agentproto.WriteFrame(c, agentproto.Hello{Version: 1, Python: "3.fake", Plan: g.plan})
				}
				for {
					var req agentproto.Request
					if err := agentproto.ReadFrame(c, &req); err != nil {
						return
					}
					out := g.run(req.Code)
					agentproto.WriteFrame(c, agentproto.Response{ID: req.ID, Exec: &agentproto.ExecResult{Stdout: agentproto.Stream{Text: out, Total: int64(len(out))}}})
				}
			}()
		}
	}()
	return nil
}

// serveSeed plays guestinit's seed port: each message reseeds the kernel's
// RNG, gives the guest its address, and is acknowledged with one byte,
// which refuses an address for a guest without a network (as guestinit
// does).
func (g *fakeGuest) serveSeed(c net.Conn) {
	for {
		s, err := guestinit.ReadSeed(c)
		if err != nil {
			return
		}
		addr := netip.AddrFrom4(s.Addr)
		g.mu.Lock()
		g.kernel = hex.EncodeToString(s.Entropy[:8])
		ok := addr.IsUnspecified() || g.planNet && g.tap != ""
		if ok && !addr.IsUnspecified() {
			g.addr = addr
		}
		g.mu.Unlock()
		if !ok {
			c.Write([]byte{guestinit.SeedFailed})
			continue
		}
		c.Write([]byte{guestinit.SeedOK})
	}
}

// newFakeFirecrackerBackend returns the Firecracker driver, running the
// test binary as its firecracker.
func newFakeFirecrackerBackend(t *testing.T) *Firecracker { return newFakeFirecrackerBackendEnv(t, "") }

// newFakeFirecrackerBackendEnv is newFakeFirecrackerBackend with env
// (NAME=VALUE words) set for the fake.
func newFakeFirecrackerBackendEnv(t *testing.T, env string) *Firecracker {
	return newFakeFirecrackerBackendOpts(t, env, FirecrackerOptions{})
}

// newFakeFirecrackerBackendOpts is newFakeFirecrackerBackendEnv with
// opts' Egress and Policy.
func newFakeFirecrackerBackendOpts(t *testing.T, env string, opts FirecrackerOptions) *Firecracker {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, f := range []string{"vmlinux", "rootfs.ext4"} {
		os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o644)
	}
	// The driver gives Firecracker an empty environment: a wrapper sets
	// the switch that makes this test binary the fake.
	wrapper := filepath.Join(dir, "firecracker")
	script := fmt.Sprintf("#!/bin/sh\nKILN_FAKE_FIRECRACKER=1 %s exec %q \"$@\"\n", env, self)
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	run := filepath.Join(os.TempDir(), fmt.Sprintf("kfc-%d", os.Getpid())) // short: socket paths
	b, err := NewFirecracker(FirecrackerOptions{
		Image:       &image.Image{Dir: dir, Key: "fake", Rootfs: "rootfs.ext4"},
		Kernel:      filepath.Join(dir, "vmlinux"),
		Firecracker: wrapper,
		StateDir:    filepath.Join(dir, "state"),
		RunDir:      run,
		NoCgroup:    true,
		Egress:      opts.Egress,
		Policy:      opts.Policy,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// TestFirecrackerBackend runs the whole Firecracker driver (process,
// template boot, snapshot, restore, vsock, hello replay) against the fake.
func TestFirecrackerBackend(t *testing.T) {
	b := newFakeFirecrackerBackend(t)
	dir := filepath.Dir(b.opts.Kernel)
	ctx := context.Background()
	for i := range 2 {
		sb, err := b.Create(ctx, sandbox.Spec{ID: fmt.Sprintf("fc%d", i)})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		if h := sb.(*sandbox.AgentConn).Hello(); h.Python != "3.fake" {
			t.Errorf("hello not replayed: %+v", h)
		}
		res, err := sb.RunPython(ctx, "print(2+2)", sandbox.ExecOptions{})
		if err != nil || strings.TrimSpace(res.Stdout.Text) != "4" {
			t.Errorf("run: %+v %v", res, err)
		}
		sb.Close()
	}
	if entries, _ := os.ReadDir(filepath.Join(dir, "state")); len(entries) != 1 {
		t.Errorf("want one template in the state dir, got %d", len(entries))
	}
}

// TestFirecrackerOldImage: a guest whose agent predates the box plan
// boots, ignores the plan on its command line and says hello without it;
// the driver refuses it, saying why, rather than hand out a box whose
// guest made up its own limits.
func TestFirecrackerOldImage(t *testing.T) {
	b := newFakeFirecrackerBackendEnv(t, "KILN_FAKE_OLD_GUEST=1")
	sb, err := b.Create(context.Background(), sandbox.Spec{ID: "old"})
	if err == nil {
		sb.Close()
		t.Fatal("a guest that did not apply the box plan was handed out")
	}
	if !errors.Is(err, ErrOldImage) {
		t.Errorf("error %v, want ErrOldImage", err)
	}
}

// TestFirecrackerClonesReseed restores two clones of one template and
// checks that they draw different random numbers, from Python's random
// module and from the guest kernel: clones share the template's memory,
// so without a reseed at restore they would draw the same.
func TestFirecrackerClonesReseed(t *testing.T) {
	b := newFakeFirecrackerBackend(t)
	ctx := context.Background()
	draws := map[string][]string{}
	for i := range 2 {
		sb, err := b.Create(ctx, sandbox.Spec{ID: fmt.Sprintf("fc%d", i)})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		for _, code := range []string{fakeDrawPython, fakeDrawKernel} {
			res, err := sb.RunPython(ctx, code, sandbox.ExecOptions{})
			if err != nil {
				t.Fatalf("run %q: %v", code, err)
			}
			draws[code] = append(draws[code], res.Stdout.Text)
		}
		sb.Close()
	}
	for code, d := range draws {
		if d[0] == d[1] {
			t.Errorf("two clones drew the same number from %q: %q", code, d[0])
		}
	}
}

// TestFirecrackerEgress: under a policy, the template's NIC is on a tap
// in Firecracker's own namespace before it boots, every clone's snapshot
// reopens a tap of its own attachment's there, and its guest is seeded
// with that attachment's address, which no other clone has; without a
// policy there is no NIC at all. (The fake checks the tap exists where
// and when Firecracker would open it.)
func TestFirecrackerEgress(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: the egress gateway and Firecracker's network namespace need root")
	}
	gw, err := egress.NewGateway(egress.Options{})
	if err != nil {
		t.Skipf("skipping: egress gateway unavailable: %v", err)
	}
	defer gw.Close()
	b := newFakeFirecrackerBackendOpts(t, "", FirecrackerOptions{Egress: gw, Policy: egress.MustParsePolicy("example.test")})
	ctx := context.Background()
	seen := map[string]bool{}
	for i := range 2 {
		sb, err := b.Create(ctx, sandbox.Spec{ID: fmt.Sprintf("fcnet%d", i)})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		defer sb.Close()
		res, err := sb.RunPython(ctx, fakeNetwork, sandbox.ExecOptions{})
		if err != nil {
			t.Fatal(err)
		}
		nb, ok := sb.(*netBox)
		if !ok {
			t.Fatalf("a box with a network is a %T", sb)
		}
		want := egress.TapName + " " + nb.Addr()
		if got := strings.TrimSpace(res.Stdout.Text); got != want {
			t.Errorf("clone %d: the guest has %q, its attachment %q", i, got, want)
		}
		if seen[nb.Addr()] {
			t.Errorf("two clones share %s", nb.Addr())
		}
		seen[nb.Addr()] = true
	}

	plain := newFakeFirecrackerBackend(t)
	sb, err := plain.Create(ctx, sandbox.Spec{ID: "fcnonet"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	res, err := sb.RunPython(ctx, fakeNetwork, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(res.Stdout.Text); got != "invalid IP" {
		t.Errorf("a guest without a policy has the network %q", got)
	}
}
