package microvm

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kiln/internal/agentproto"
	"kiln/internal/image"
	"kiln/internal/sandbox"
)

// TestMain lets the test binary play Firecracker: the driver under test
// starts it as its "firecracker" binary (see TestFirecrackerBackend).
func TestMain(m *testing.M) {
	if os.Getenv("KILN_FAKE_FIRECRACKER") == "1" {
		os.Exit(runFakeFirecracker(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// runFakeFirecracker serves the API (spec-checked, as fakeFirecracker) on
// --api-sock, and plays the guest's agent behind the vsock socket: it says
// hello after a boot, but not after a snapshot restore (the driver replays
// the template's hello), and answers every python request with "4\n".
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
	f.hook = func(op string, body map[string]any) error {
		switch op {
		case "PUT /vsock":
			udsPath = body["uds_path"].(string)
		case "PUT /actions":
			return serveFakeAgent(udsPath, true)
		case "PUT /snapshot/create":
			for _, k := range []string{"snapshot_path", "mem_file_path"} {
				if err := os.WriteFile(body[k].(string), []byte(k), 0o600); err != nil {
					return err
				}
			}
		case "PUT /snapshot/load":
			for _, p := range []string{body["snapshot_path"].(string), body["mem_backend"].(map[string]any)["backend_path"].(string)} {
				if _, err := os.Stat(p); err != nil {
					return err
				}
			}
			return serveFakeAgent(body["vsock_override"].(map[string]any)["uds_path"].(string), false)
		}
		return nil
	}
	http.Serve(l, f)
	if bad {
		return 2
	}
	return 0
}

func serveFakeAgent(uds string, hello bool) error {
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
				if string(buf[:n]) != fmt.Sprintf("CONNECT %d\n", agentVsockPort) {
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
					agentproto.WriteFrame(c, agentproto.Response{ID: req.ID, Exec: &agentproto.ExecResult{Stdout: agentproto.Stream{Text: "4\n", Total: 2}}})
				}
			}()
		}
	}()
	return nil
}

// TestFirecrackerBackend runs the whole Firecracker driver (process,
// template boot, snapshot, restore, vsock, hello replay) against the fake.
func TestFirecrackerBackend(t *testing.T) {
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
	defer b.Close()
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
