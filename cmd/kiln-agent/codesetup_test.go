package main

import (
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"kiln/internal/agentproto"
)

// TestCodeSetupReachesCode starts kiln-agent with -code-rlimits and
// -code-oom-score-adj and reads, from a shell command, from a child it
// forks at once and from the Python kernel, the limits code runs under:
// each must have them from its first instruction.
func TestCodeSetupReachesCode(t *testing.T) {
	py, err := exec.LookPath("/usr/bin/python3")
	if err != nil {
		t.Skip("needs /usr/bin/python3")
	}
	cmd := exec.Command(buildAgent(t), "-workspace", t.TempDir(), "-python", py, "-preload", "",
		"-code-rlimits", "RLIMIT_CORE=0,RLIMIT_NOFILE=200,RLIMIT_NPROC=4000", "-code-oom-score-adj", "1000")
	cmd.Stderr = os.Stderr
	in, out := pipes(t, cmd)
	var hello agentproto.Hello
	if err := agentproto.ReadFrame(out, &hello); err != nil {
		t.Fatalf("reading hello: %v", err)
	}
	if hello.Python == "" {
		t.Fatalf("hello %+v: no python kernel", hello)
	}
	const want = "1000 4000 200 0"
	call := func(id uint64, op, code string) string {
		t.Helper()
		if err := agentproto.WriteFrame(in, &agentproto.Request{ID: id, Op: op, Code: code}); err != nil {
			t.Fatal(err)
		}
		var resp agentproto.Response
		if err := agentproto.ReadFrame(out, &resp); err != nil {
			t.Fatalf("reading response: %v", err)
		}
		if resp.Exec == nil {
			t.Fatalf("%s: %+v", code, resp)
		}
		return strings.Join(strings.Fields(resp.Exec.Stdout.Text+resp.Exec.Stderr.Text), " ")
	}
	limits := `echo $(cat /proc/self/oom_score_adj) $(ulimit -u) $(ulimit -n) $(ulimit -c)`
	if got := call(1, agentproto.OpShell, limits); got != want {
		t.Errorf("a shell command: %q, want %q", got, want)
	}
	// A child the command forks first thing, before the agent could
	// have set anything from outside.
	if got := call(2, agentproto.OpShell, "bash -c '"+limits+"'"); got != want {
		t.Errorf("a shell command's first child: %q, want %q", got, want)
	}
	got := call(3, agentproto.OpPython, `import resource
print(open("/proc/self/oom_score_adj").read().strip(), *(resource.getrlimit(r)[0] for r in (resource.RLIMIT_NPROC, resource.RLIMIT_NOFILE, resource.RLIMIT_CORE)))`)
	if got != want {
		t.Errorf("the python kernel: %q, want %q", got, want)
	}
	in.Close()
	if err := cmd.Wait(); err != nil {
		t.Errorf("kiln-agent exited: %v", err)
	}
}

// TestCodeSetupBadFlags: a limit the agent does not know is refused at
// start, not ignored.
func TestCodeSetupBadFlags(t *testing.T) {
	bin := buildAgent(t)
	for _, v := range []string{"RLIMIT_AS=1", "RLIMIT_NPROC", "RLIMIT_NPROC=-1"} {
		out, err := exec.Command(bin, "-code-rlimits", v).CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), "bad -code-rlimits") {
			t.Errorf("-code-rlimits %s: %v, output %q", v, err, out)
		}
	}
	// ExecCode refuses a setup it does not know and a missing program.
	for _, args := range [][]string{{"-exec-code", "nice=1", "--", "/bin/true"}, {"-exec-code", "oom=1000"}, {"-exec-code", "oom=2000", "--", "/bin/true"}} {
		out, err := exec.Command(bin, args...).CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 127 {
			t.Errorf("%v: %v, output %q", args, err, out)
		}
	}
}

func pipes(t *testing.T, cmd *exec.Cmd) (io.WriteCloser, io.Reader) {
	t.Helper()
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
	t.Cleanup(func() { cmd.Process.Kill() })
	return in, out
}

// BenchmarkShellCall is one shell command's round trip through the agent,
// with code started directly (plain) and through ExecCode (setup), which
// costs one more exec of kiln-agent per command.
func BenchmarkShellCall(b *testing.B) {
	bin := filepath.Join(b.TempDir(), "kiln-agent")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		b.Skipf("go build: %v\n%s", err, out)
	}
	for _, c := range []struct {
		name  string
		flags []string
	}{
		{"plain", nil},
		{"setup", []string{"-code-rlimits", "RLIMIT_CORE=0,RLIMIT_NOFILE=1024,RLIMIT_NPROC=4000", "-code-oom-score-adj", "1000"}},
	} {
		b.Run(c.name, func(b *testing.B) {
			cmd := exec.Command(bin, append([]string{"-workspace", b.TempDir(), "-python", ""}, c.flags...)...)
			in, err := cmd.StdinPipe()
			if err != nil {
				b.Fatal(err)
			}
			out, err := cmd.StdoutPipe()
			if err != nil {
				b.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			defer func() { in.Close(); cmd.Wait() }()
			var hello agentproto.Hello
			if err := agentproto.ReadFrame(out, &hello); err != nil {
				b.Fatal(err)
			}
			for i := 0; b.Loop(); i++ {
				if err := agentproto.WriteFrame(in, &agentproto.Request{ID: uint64(i + 1), Op: agentproto.OpShell, Code: "true"}); err != nil {
					b.Fatal(err)
				}
				var resp agentproto.Response
				if err := agentproto.ReadFrame(out, &resp); err != nil || resp.Exec == nil || resp.Exec.ExitCode != 0 {
					b.Fatalf("%+v %v", resp, err)
				}
			}
		})
	}
}
