package sessiontest

import (
	"context"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// KillOptions say what a backend's host can see of its boxes' limits.
type KillOptions struct {
	// OOMCounted: the host counts the box's OOM kills (a cgroup around
	// the box), so the result says for sure that memory ran out. Without
	// it the result only says what the limit is.
	OOMCounted bool
	// PidsCounted: the host counts forks refused at the box's pids limit
	// (the cgroup's pids.events), so the result names that limit. Without
	// it the refused fork is left as the code's own error.
	PidsCounted bool
	// Scale stretches the time limit (emulated microVMs).
	Scale float64
}

// RunKills hits each limit of a real backend's box through the session
// layer: memory, pids, the workspace and /tmp. The results name the limit
// with its value, as far as the backend can tell it, and say what
// survived.
func RunKills(t *testing.T, b sandbox.Backend, opts KillOptions) {
	if opts.Scale == 0 {
		opts.Scale = 1
	}
	timeout := time.Duration(float64(time.Minute) * opts.Scale)
	limits := sandbox.Limits{MemoryBytes: 256 << 20, Pids: 64, WorkspaceBytes: 8 << 20, TmpBytes: 4 << 20}
	mgr := session.NewManager(session.Options{Backend: b, Limits: limits, DefaultTimeout: timeout, MaxTimeout: timeout})
	t.Cleanup(mgr.Close)
	ctx := context.Background()
	sess, err := mgr.Get("test", "kills")
	if err != nil {
		t.Fatal(err)
	}
	run := func(t *testing.T, python bool, code string) *session.Outcome {
		t.Helper()
		var out *session.Outcome
		var err error
		if python {
			out, err = sess.RunPython(ctx, code, timeout)
		} else {
			out, err = sess.RunShell(ctx, code, timeout)
		}
		if err != nil {
			t.Fatal(err)
		}
		var e string
		if out.Error != nil {
			e = out.Error.Name + ": " + out.Error.Value
		}
		t.Logf("error %q; note %q; stderr %.200q", e, out.Note, out.Stderr.Text)
		return out
	}

	t.Run("memory", func(t *testing.T) {
		run(t, true, "kept = 1\nopen('kept.txt', 'w').write('x')")
		// Grown in steps of touched pages, so the limit kills rather
		// than one allocation being refused.
		out := run(t, true, "chunks = []\nwhile True: chunks.append(b'x' * (32 << 20))")
		if out.Error == nil {
			t.Fatalf("an allocation past the memory limit succeeded: %+v", out)
		}
		if out.Error.Name == "MemoryError" {
			// Refused, not killed: the box's kernel said no in time. The
			// session lost nothing.
			if strings.Contains(out.Note, "restarted") {
				t.Errorf("a MemoryError is not a restart: %q", out.Note)
			}
			return
		}
		want := "the sandbox ran out of memory (limit 256 MiB)"
		if !opts.OOMCounted {
			want = "256 MiB" // and that the backend cannot tell the cause
		}
		if !strings.Contains(out.Error.Value+"; "+out.Note, want) {
			t.Fatalf("an allocation past the memory limit: want %q in %+v %+v", want, out, out.Error)
		}
		after := run(t, true, "'kept' in dir()")
		switch {
		case out.Restarted && strings.Contains(out.Note, "files in the workspace are gone"):
		case !out.Restarted && strings.Contains(out.Note, "files in the workspace are kept"):
			if r := run(t, true, "open('kept.txt').read()"); r.Result["text/plain"] != "'x'" {
				t.Errorf("the workspace file is gone: %+v", r)
			}
		default:
			t.Errorf("the note does not say what survived: %q", out.Note)
		}
		if after.Result["text/plain"] != "False" {
			t.Errorf("the variables survived the kill: %+v", after)
		}
	})

	t.Run("pids", func(t *testing.T) {
		out := run(t, true, `import subprocess
ps, refused = [], None
try:
    for i in range(200):
        ps.append(subprocess.Popen(['sleep', '60']))
except OSError as e:
    refused = e
for p in ps:
    p.kill()
    p.wait()
print(len(ps), refused)
`)
		if !strings.Contains(out.Stdout.Text, "Errno") {
			t.Fatalf("no fork was refused: %q %+v", out.Stdout.Text, out.Error)
		}
		const want = "the process limit (64) was reached"
		if opts.PidsCounted && (!strings.Contains(out.Note, want) || !strings.Contains(out.Note, "the session's state is kept")) {
			t.Errorf("a fork past the pids limit: stdout %q, note %q", out.Stdout.Text, out.Note)
		}
		if out := run(t, false, "echo after"); strings.Contains(out.Note, "process limit") {
			t.Errorf("the next call still blames the pids limit: %q", out.Note)
		}
	})

	t.Run("workspace", func(t *testing.T) {
		out := run(t, false, "dd if=/dev/zero of=big bs=1M count=20")
		if out.ExitCode == 0 || !strings.Contains(out.Note, "the workspace is full (8 MiB)") {
			t.Errorf("dd into a small workspace: exit %d, note %q", out.ExitCode, out.Note)
		}
		out = run(t, true, "open('big2', 'wb').write(b'x' * (20 << 20))")
		if out.Error == nil || !strings.Contains(out.Note, "the workspace is full (8 MiB)") {
			t.Errorf("python writing into a full workspace: %+v", out)
		}
		out = run(t, false, "rm -f big big2; dd if=/dev/zero of=/tmp/big bs=1M count=20")
		if out.ExitCode == 0 || !strings.Contains(out.Note, "the /tmp directory is full (4 MiB)") {
			t.Errorf("dd into a small /tmp: exit %d, note %q", out.ExitCode, out.Note)
		}
	})
}
