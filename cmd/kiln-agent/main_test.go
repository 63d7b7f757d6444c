package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"kiln/internal/agentproto"
)

// buildAgent builds kiln-agent into a temporary directory.
func buildAgent(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "kiln-agent")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Skipf("go build: %v\n%s", err, out)
	}
	return bin
}

// TestFlagsReachTheAgent runs kiln-agent as a backend does, on its stdin
// and stdout, and sees its flags take effect: the preload list in the
// hello and the workspace as the directory commands run in.
func TestFlagsReachTheAgent(t *testing.T) {
	py, err := exec.LookPath("/usr/bin/python3")
	if err != nil {
		t.Skip("needs /usr/bin/python3")
	}
	ws := t.TempDir()
	cmd := exec.Command(buildAgent(t), "-workspace", ws, "-python", py, "-preload", " json, ,")
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		in.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("kiln-agent exited: %v", err)
		}
	}()

	var hello agentproto.Hello
	if err := agentproto.ReadFrame(out, &hello); err != nil {
		t.Fatalf("reading hello: %v", err)
	}
	if hello.Error != "" || hello.Python == "" || !slices.Equal(hello.Preloaded, []string{"json"}) {
		t.Fatalf("hello %+v, want python with json preloaded", hello)
	}
	if err := agentproto.WriteFrame(in, &agentproto.Request{ID: 1, Op: agentproto.OpShell, Code: "pwd"}); err != nil {
		t.Fatal(err)
	}
	var resp agentproto.Response
	if err := agentproto.ReadFrame(out, &resp); err != nil {
		t.Fatalf("reading response: %v", err)
	}
	if resp.Exec == nil || strings.TrimSpace(resp.Exec.Stdout.Text) != ws {
		t.Fatalf("pwd: %+v, want %s", resp, ws)
	}
}

// TestZygoteWithoutPython: the zygote mode needs a python and says so.
func TestZygoteWithoutPython(t *testing.T) {
	out, err := exec.Command(buildAgent(t), "-zygote", "-python", "").CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 {
		t.Fatalf("exit %v, want status 1; output %q", err, out)
	}
	if !strings.Contains(string(out), "kiln-agent: a zygote needs python") {
		t.Fatalf("output %q", out)
	}
}
