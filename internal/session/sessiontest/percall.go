package sessiontest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

// RunPerCall checks per-call mode on top of a real backend, at the session
// layer (session.Manager.RunOnce, with a warm pool): every call runs in a
// box that has never run model code and is destroyed afterwards, so
// nothing one call plants (a variable, a module attribute, an environment
// variable, a file in /work, /tmp or /dev/shm, a process) is visible to
// the next; files staged with a call are there for it, and only what the
// call created or changed comes back.
func RunPerCall(t *testing.T, b sandbox.Backend, opts sandboxtest.Options) {
	if opts.Scale == 0 {
		opts.Scale = 1
	}
	lim := opts.Limits
	if lim.MemoryBytes == 0 {
		lim.MemoryBytes = 256 << 20
	}
	if lim.Pids == 0 {
		lim.Pids = 64
	}
	mgr := session.NewManager(session.Options{
		Backend:     b,
		Mode:        session.ModePerCall,
		Limits:      lim,
		PoolSize:    2,
		PoolWorkers: 2,
	})
	t.Cleanup(mgr.Close)
	timeout := time.Duration(float64(60*time.Second) * opts.Scale)
	run := func(t *testing.T, lang session.Language, code string, files map[string][]byte) (*session.Outcome, []session.Produced) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		out, produced, err := mgr.RunOnce(ctx, lang, code, files, timeout)
		if err != nil {
			t.Fatalf("per-call %q: %v", code, err)
		}
		if out.Error != nil && lang == session.Python {
			t.Fatalf("per-call %q: %+v", code, out.Error)
		}
		return out, produced
	}
	text := func(o *session.Outcome) string {
		return o.Stdout.Text + o.Stderr.Text + o.Result["text/plain"]
	}

	t.Run("a variable planted by one call is invisible to the next", func(t *testing.T) {
		c := sandboxtest.Canary()
		run(t, session.Python, fmt.Sprintf(`import os, sys, builtins, json
planted = %[1]q
builtins.kiln_planted = %[1]q
json.kiln_planted = %[1]q
os.environ["KILN_PLANTED"] = %[1]q
sys.path.insert(0, "/tmp/%[1]s")`, c), nil)
		out, _ := run(t, session.Python, `import os, sys, builtins, json
[globals().get("planted"), getattr(builtins, "kiln_planted", None), getattr(json, "kiln_planted", None), os.environ.get("KILN_PLANTED"), [p for p in sys.path if "kiln-canary" in p]]`, nil)
		if got := text(out); strings.Contains(got, c) || !strings.Contains(got, "[None, None, None, None, []]") {
			t.Errorf("the second call sees the first's state: %s", got)
		}
	})

	t.Run("a file planted by one call is invisible to the next", func(t *testing.T) {
		c := sandboxtest.Canary()
		run(t, session.Shell, fmt.Sprintf("echo %[1]s > /work/planted; echo %[1]s > /tmp/planted; echo %[1]s > /dev/shm/planted 2>/dev/null; echo 'export KILN_PLANTED=%[1]s' >> ~/.bashrc; true", c), nil)
		out, _ := run(t, session.Shell, "cat /work/planted /tmp/planted /dev/shm/planted ~/.bashrc 2>&1; ls -a /work /tmp; env", nil)
		if strings.Contains(text(out), c) {
			t.Errorf("the second call sees the first's files:\n%s", text(out))
		}
	})

	t.Run("a process started by one call is gone for the next", func(t *testing.T) {
		marker := "kiln-percall-" + sandboxtest.Canary()[12:]
		run(t, session.Shell, fmt.Sprintf("(exec -a %s sleep 600 >/dev/null 2>&1 &); echo started", marker), nil)
		out, _ := run(t, session.Shell, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '", nil)
		if strings.Contains(text(out), marker) {
			t.Errorf("the second call sees the first's process:\n%s", text(out))
		}
		if !opts.HostProcesses {
			return
		}
		deadline := time.Now().Add(time.Duration(float64(10*time.Second) * opts.Scale))
		for len(sandboxtest.Leftovers(marker)) > 0 && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if l := sandboxtest.Leftovers(marker); len(l) > 0 {
			t.Errorf("the first call's process outlived its box: %v", l)
		}
	})

	t.Run("staged files are there, and only what the call changed comes back", func(t *testing.T) {
		out, produced := run(t, session.Python, "data = open('in.txt').read()\nopen('out.txt', 'w').write(data.upper())\nopen('keep.txt', 'a').write('+')\nlen(data)",
			map[string][]byte{"in.txt": []byte("hello"), "keep.txt": []byte("k"), "sub/dir/same.bin": {0, 1, 2}})
		if out.Result["text/plain"] != "5" {
			t.Fatalf("the call did not see its staged file: %+v", out.ExecResult)
		}
		got := map[string]string{}
		for _, p := range produced {
			got[p.Path] = string(p.Data)
		}
		if got["out.txt"] != "HELLO" || got["keep.txt"] != "k+" || len(got) != 2 {
			t.Errorf("produced %v, want out.txt and keep.txt only", got)
		}
	})

	t.Run("concurrent calls never share a box", func(t *testing.T) {
		const n = 6
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			seen []string
		)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				defer cancel()
				out, _, err := mgr.RunOnce(ctx, session.Python, fmt.Sprintf(`import builtins, os
prior = getattr(builtins, "kiln_call", None)
builtins.kiln_call = %d
open("/tmp/kiln-call", "a").write("%d")
(prior, open("/tmp/kiln-call").read())`, i, i), nil, timeout)
				v := fmt.Sprint(err)
				if err == nil {
					v = out.Result["text/plain"]
				}
				mu.Lock()
				seen = append(seen, v)
				mu.Unlock()
			}()
		}
		wg.Wait()
		for i, v := range seen {
			if !strings.HasPrefix(v, "(None, '") || len(v) != len("(None, '0')") {
				t.Errorf("call %d met another call's state: %s", i, v)
			}
		}
	})
}
