package sandboxtest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// KilnTags are the build tags BuildKiln builds kiln with. The default
// build leaves the optional backends out (internal/cli/features.go), so a
// test package that starts kiln with one of them sets this in an init.
var KilnTags string

var (
	kilnOnce sync.Once
	kilnPath string
	kilnErr  error
)

// BuildKiln builds the kiln server (static) once per test binary, next to
// a kiln-agent, and returns its path.
func BuildKiln(t testing.TB) string {
	t.Helper()
	agent := BuildAgent(t)
	kilnOnce.Do(func() {
		if dir := os.Getenv(PrebuiltEnv); dir != "" {
			kilnPath = filepath.Join(dir, "kiln")
			_, kilnErr = os.Stat(kilnPath)
			return
		}
		out, err := exec.Command("go", "env", "GOMOD").Output()
		if err != nil {
			kilnErr = fmt.Errorf("finding module root: %w", err)
			return
		}
		kilnPath = filepath.Join(filepath.Dir(agent), "kiln")
		cmd := exec.Command("go", "build", "-tags", KilnTags, "-o", kilnPath, "./cmd/kiln")
		cmd.Dir = filepath.Dir(strings.TrimSpace(string(out)))
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			kilnErr = fmt.Errorf("building kiln: %v\n%s", err, out)
		}
	})
	if kilnErr != nil {
		t.Fatal(kilnErr)
	}
	return kilnPath
}

// StdioServer is a `kiln mcp` process spoken to in raw JSON-RPC lines, so
// tests can send what no SDK client would.
type StdioServer struct {
	Cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan []byte
	Stderr *strings.Builder
}

// StartStdio starts `kiln mcp` with args and reads its stdout line by line.
func StartStdio(t testing.TB, args ...string) *StdioServer {
	t.Helper()
	kiln := BuildKiln(t)
	cmd := exec.Command(kiln, append([]string{"mcp"}, args...)...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	s := &StdioServer{Cmd: cmd, stdin: stdin, lines: make(chan []byte, 64), Stderr: new(strings.Builder)}
	cmd.Stderr = &lockedWriter{w: s.Stderr}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(s.lines)
		r := bufio.NewReaderSize(stdout, 1<<20)
		for {
			line, err := r.ReadBytes('\n')
			if len(line) > 0 {
				s.lines <- line
			}
			if err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return s
}

// Send writes one raw line.
func (s *StdioServer) Send(t testing.TB, line string) {
	t.Helper()
	if _, err := io.WriteString(s.stdin, line+"\n"); err != nil {
		t.Fatalf("writing to kiln: %v", err)
	}
}

// CloseInput closes the server's stdin: the client went away.
func (s *StdioServer) CloseInput() { s.stdin.Close() }

// Message is one JSON-RPC message from the server.
type Message struct {
	ID     json.RawMessage `json:"id"`
	Method string          `json:"method"`
	Result json.RawMessage `json:"result"`
	Error  *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
	Raw []byte `json:"-"`
}

// Await reads messages until the response with id (a JSON literal: 3,
// "x", null) arrives. Every line must be a JSON-RPC message: nothing else
// may reach stdout.
func (s *StdioServer) Await(t testing.TB, id string, timeout time.Duration) *Message {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case line, ok := <-s.lines:
			if !ok {
				t.Fatalf("kiln closed its stdout waiting for %s; stderr:\n%s", id, s.Stderr)
			}
			var m Message
			if err := json.Unmarshal(line, &m); err != nil {
				t.Fatalf("not a JSON-RPC message on stdout: %q", truncate(line))
			}
			m.Raw = line
			if string(m.ID) == id {
				return &m
			}
		case <-deadline:
			t.Fatalf("no response %s within %s; stderr:\n%s", id, timeout, s.Stderr)
		}
	}
}

// Initialize performs the MCP handshake.
func (s *StdioServer) Initialize(t testing.TB) {
	t.Helper()
	s.Send(t, `{"jsonrpc":"2.0","id":"init","method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"hostile","version":"1"}}}`)
	if m := s.Await(t, `"init"`, time.Minute); m.Error != nil {
		t.Fatalf("initialize: %+v", m.Error)
	}
	s.Send(t, `{"jsonrpc":"2.0","method":"notifications/initialized"}`)
}

type lockedWriter struct {
	mu sync.Mutex
	w  *strings.Builder
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// Leftovers lists host processes whose command line contains marker.
func Leftovers(marker string) []string { return leftovers(marker) }
