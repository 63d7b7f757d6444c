package microvm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"kiln/internal/agentproto"
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
		case "PUT /vsock":
			udsPath = body["uds_path"].(string)
		case "PUT /actions":
			return g.serve(udsPath, true)
		case "PUT /snapshot/create":
			if err := os.WriteFile(body["snapshot_path"].(string), []byte("snapshot_path"), 0o600); err != nil {
				return err
			}
			// The memory carries the guest's random state, as a real
			// snapshot does.
			if err := os.WriteFile(body["mem_file_path"].(string), g.save(), 0o600); err != nil {
				return err
			}
		case "PUT /snapshot/load":
			if _, err := os.Stat(body["snapshot_path"].(string)); err != nil {
				return err
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
)

// fakeGuest is the state a snapshot carries: Python's random state and
// the kernel's, both drawn at boot. Running sandbox.ReseedCell reseeds the
// first, a seed message on guestinit's seed port the second.
type fakeGuest struct {
	mu     sync.Mutex
	python string
	kernel string
}

func newFakeGuest() *fakeGuest { return &fakeGuest{python: rand.Text(), kernel: rand.Text()} }

func (g *fakeGuest) save() []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	return []byte(g.python + " " + g.kernel)
}

func (g *fakeGuest) load(mem []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.python, g.kernel, _ = strings.Cut(string(mem), " ")
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
					agentproto.WriteFrame(c, agentproto.Hello{Version: 1, Python: "3.fake"})
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
// RNG and is acknowledged with one byte.
func (g *fakeGuest) serveSeed(c net.Conn) {
	msg := make([]byte, guestinit.SeedMessageSize)
	for {
		if _, err := io.ReadFull(c, msg); err != nil {
			return
		}
		g.mu.Lock()
		g.kernel = hex.EncodeToString(msg[:8])
		g.mu.Unlock()
		c.Write([]byte{1})
	}
}

// newFakeFirecrackerBackend returns the Firecracker driver, running the
// test binary as its firecracker.
func newFakeFirecrackerBackend(t *testing.T) *Firecracker {
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
	script := fmt.Sprintf("#!/bin/sh\nKILN_FAKE_FIRECRACKER=1 exec %q \"$@\"\n", self)
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
