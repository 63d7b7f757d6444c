package mcpserver_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root for the jail backend")
	}
}

// toolCall is a raw tools/call line.
func toolCall(id int, tool string, args string) string {
	return fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":%q,"arguments":%s}}`, id, tool, args)
}

// resultText is the text of a tools/call result, and whether it is an error.
func resultText(t *testing.T, m *sandboxtest.Message) (string, bool) {
	t.Helper()
	if m.Error != nil {
		return m.Error.Message, true
	}
	var res struct {
		Content []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		} `json:"content"`
		IsError bool `json:"isError"`
	}
	if err := json.Unmarshal(m.Result, &res); err != nil {
		t.Fatalf("result: %v: %s", err, m.Raw)
	}
	var b strings.Builder
	for _, c := range res.Content {
		b.WriteString(c.Text)
	}
	return b.String(), res.IsError
}

// TestHostileProtocol sends `kiln mcp` what a broken or hostile client
// would. Each gets a clear error and the server keeps serving.
func TestHostileProtocol(t *testing.T) {
	needRoot(t)
	srv := sandboxtest.StartStdio(t, "--pool", "1", "--preload", "", "--timeout", "20s", "--max-output", "2000")
	srv.Initialize(t)
	id := 100
	alive := func(t *testing.T) {
		t.Helper()
		id++
		srv.Send(t, toolCall(id, "run_python", `{"code":"6 * 7"}`))
		if text, isErr := resultText(t, srv.Await(t, strconv.Itoa(id), time.Minute)); isErr || !strings.Contains(text, "42") {
			t.Fatalf("the server no longer serves: %q", text)
		}
	}
	// Malformed lines have no id to answer: the server may answer with a
	// null id or not at all, but must keep serving.
	for _, line := range []string{
		`{"jsonrpc":"2.0","id":1,"method":`,
		`not json at all`,
		`[1, 2`,
		`"a string"`,
		`{}`,
		`{"jsonrpc":"1.0","id":"v1","method":"tools/list"}`,
		"\xff\xfe\x00garbage",
		`{"jsonrpc":"2.0","id":{"nested":true},"method":"tools/list"}`,
		`{"jsonrpc":"2.0","method":"tools/call","params":{"name":"run_shell","arguments":{"command":"touch /work/notification"}}}`,
	} {
		t.Run("malformed "+strconv.Quote(line[:min(len(line), 20)]), func(t *testing.T) {
			srv.Send(t, line)
			alive(t)
		})
	}
	cases := []struct {
		name, tool, args string
		want             string // in the error text
	}{
		{"unknown tool", "rm_rf", `{}`, "rm_rf"},
		{"code is a number", "run_python", `{"code":42}`, "code"},
		{"code is null", "run_python", `{"code":null}`, ""},
		{"arguments are a list", "run_shell", `[1,2]`, ""},
		{"timeout is a string", "run_python", `{"code":"1","timeout_s":"soon"}`, "timeout_s"},
		{"negative timeout", "run_python", `{"code":"1","timeout_s":-5}`, "timeout"},
		{"files is a list", "run_python", `{"code":"1","files":[1]}`, "files"},
		{"unknown argument", "run_python", `{"code":"1","sudo":true}`, ""},
		{"bad session name", "run_python", `{"code":"1","session":"../../etc"}`, "session"},
		{"path is an object", "read_file", `{"path":{"a":1}}`, "path"},
		{"bad encoding", "write_file", `{"path":"a","content":"x","encoding":"rot13"}`, "encoding"},
		{"bad base64", "write_file", `{"path":"a","content":"!!","encoding":"base64"}`, "base64"},
		{"10 MB of code", "run_python", `{"code":"` + strings.Repeat("x", 10<<20) + `"}`, "limit"},
		{"empty code", "run_shell", `{"command":"   "}`, "empty"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id++
			srv.Send(t, toolCall(id, c.tool, c.args))
			text, isErr := resultText(t, srv.Await(t, strconv.Itoa(id), time.Minute))
			if !isErr {
				t.Errorf("accepted: %q", text[:min(len(text), 200)])
			}
			if !strings.Contains(text, c.want) {
				t.Errorf("unclear error %q, want it to mention %q", text[:min(len(text), 300)], c.want)
			}
			alive(t)
		})
	}
	t.Run("invalid UTF-8 in code", func(t *testing.T) {
		id++
		srv.Send(t, toolCall(id, "run_python", "{\"code\":\"s = '\xff\xfe'\\nlen(s)\"}"))
		m := srv.Await(t, strconv.Itoa(id), time.Minute)
		text, _ := resultText(t, m)
		if !utf8.ValidString(text) {
			t.Errorf("invalid UTF-8 came back: %q", text)
		}
		alive(t)
	})
	t.Run("binary output", func(t *testing.T) {
		id++
		srv.Send(t, toolCall(id, "run_shell", `{"command":"head -c 3000 /dev/urandom; printf '\\000\\377\\033[2J'; head -c 3000 /dev/urandom >&2"}`))
		m := srv.Await(t, strconv.Itoa(id), time.Minute)
		if !utf8.Valid(m.Raw) {
			t.Errorf("the response line is not valid UTF-8")
		}
		text, _ := resultText(t, m)
		if !utf8.ValidString(text) {
			t.Errorf("invalid UTF-8 in the result text")
		}
		alive(t)
	})
	t.Run("binary output from python and a huge line", func(t *testing.T) {
		id++
		srv.Send(t, toolCall(id, "run_python", `{"code":"import sys, os\nsys.stdout.buffer.write(os.urandom(5000))\nsys.stdout.flush()\nprint('z' * 5000000)\nb'\\xff' * 10"}`))
		m := srv.Await(t, strconv.Itoa(id), time.Minute)
		text, _ := resultText(t, m)
		if !utf8.ValidString(text) || len(m.Raw) > 1<<20 {
			t.Errorf("result of %d bytes, valid UTF-8 %v", len(m.Raw), utf8.ValidString(text))
		}
		if !strings.Contains(text, "truncated") {
			t.Errorf("the cap does not say so: %q", text[:min(len(text), 300)])
		}
		alive(t)
	})
	t.Run("disconnect mid-call", func(t *testing.T) {
		marker := "disc-" + strconv.Itoa(5000000+os.Getpid()%100000)
		id++
		srv.Send(t, toolCall(id, "run_shell", `{"command":"(exec -a `+marker+` sleep 600) & wait","timeout_s":300}`))
		waitFor(t, func() bool { return len(sandboxtest.Leftovers(marker)) > 0 }, "the planted process to start")
		pid := srv.Cmd.Process.Pid
		srv.CloseInput()
		srv.Cmd.Wait()
		waitFor(t, func() bool { return len(sandboxtest.Leftovers(marker)) == 0 }, "the call's processes to die")
		waitFor(t, func() bool { return len(kilnGroups(pid)) == 0 }, "the server's cgroups to go")
		if srv.Cmd.ProcessState.ExitCode() != 0 {
			t.Errorf("kiln exited with %d on a disconnect; stderr:\n%s", srv.Cmd.ProcessState.ExitCode(), srv.Stderr)
		}
	})
}

// TestDisconnectInMemory drops one client mid-call while another keeps
// calling the same server.
func TestDisconnectInMemory(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		srv := serve(t, b, session.Options{DefaultTimeout: time.Minute, Grace: time.Second})
		leaver, stayer := dial(t, srv), dial(t, srv)
		marker := "discmem-" + strconv.Itoa(5000000+os.Getpid()%100000)
		errc := make(chan error, 1)
		go func() {
			_, err := leaver.CallTool(context.Background(), &mcp.CallToolParams{Name: "run_shell", Arguments: map[string]any{"command": "exec -a " + marker + " sleep 600"}})
			errc <- err
		}()
		waitFor(t, func() bool { return len(sandboxtest.Leftovers(marker)) > 0 }, "the planted process to start")
		leaver.Close()
		<-errc
		waitFor(t, func() bool { return len(sandboxtest.Leftovers(marker)) == 0 }, "the dropped call's processes to die")
		if res := call(t, stayer, "run_python", map[string]any{"code": "6 * 7"}); !strings.Contains(text(res), "42") {
			t.Errorf("the other client: %q", text(res))
		}
	})
}

// kilnGroups lists the jail cgroups of server pid.
func kilnGroups(pid int) []string {
	var out []string
	for _, pat := range []string{"/sys/fs/cgroup/*/kiln/%d", "/sys/fs/cgroup/kiln/%d"} {
		m, _ := filepath.Glob(fmt.Sprintf(pat, pid))
		out = append(out, m...)
	}
	return out
}

// waitFor polls cond; what it waits for must happen, not happen quickly.
func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
