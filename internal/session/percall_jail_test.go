package session_test

import (
	"context"
	"os"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

func TestMain(m *testing.M) {
	jail.MaybeInit() // the jail re-executes this binary as each box's init
	os.Exit(m.Run())
}

// jailBackend is the jail, with boxes forked from a zygote or not.
func jailBackend(t testing.TB, zygote bool) *jail.Backend {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("the jail needs root (user namespaces with a uid range, cgroups)")
	}
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Zygote: zygote})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

func TestPerCallIsolation(t *testing.T) {
	sandboxtest.RunPerCall(t, jailBackend(t, false), sandboxtest.Options{HostProcesses: true})
}

func TestPerCallIsolationZygote(t *testing.T) {
	sandboxtest.RunPerCall(t, jailBackend(t, true), sandboxtest.Options{HostProcesses: true})
}

// TestSessionFirstBoxFromPool checks that a new session's box is one the
// pool made ahead of time: it already holds the preloaded modules.
func TestSessionFirstBoxFromPool(t *testing.T) {
	mgr := session.NewManager(session.Options{Backend: jailBackend(t, false), PoolSize: 1, Preload: []string{"json"}})
	defer mgr.Close()
	s, err := mgr.Get("local", "first")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := s.RunPython(ctx, "import sys; 'json' in sys.modules", time.Minute)
	if err != nil || out.Result["text/plain"] != "True" || !out.Fresh {
		t.Fatalf("first call: %v %+v", err, out)
	}
}

func benchManager(b *testing.B, mode session.Mode, zygote bool) *session.Manager {
	mgr := session.NewManager(session.Options{
		Backend:     jailBackend(b, zygote),
		Mode:        mode,
		Preload:     []string{"numpy", "pandas"},
		PoolSize:    2,
		PoolWorkers: 2,
	})
	b.Cleanup(mgr.Close)
	return mgr
}

// BenchmarkSessionCall is a print(2+2) round trip in a warm session.
func BenchmarkSessionCall(b *testing.B) {
	mgr := benchManager(b, session.ModeSession, false)
	s, err := mgr.Get("local", "bench")
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	if _, err := s.RunPython(ctx, "1", time.Minute); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		if out, err := s.RunPython(ctx, "print(2+2)", time.Minute); err != nil || out.Stdout.Text != "4\n" {
			b.Fatalf("%v %+v", err, out)
		}
	}
}

func benchRunOnce(b *testing.B, zygote bool) {
	mgr := benchManager(b, session.ModePerCall, zygote)
	ctx := context.Background()
	if _, _, err := mgr.RunOnce(ctx, session.Python, "1", nil, time.Minute); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		out, _, err := mgr.RunOnce(ctx, session.Python, "print(2+2)", nil, time.Minute)
		if err != nil || out.Stdout.Text != "4\n" {
			b.Fatalf("%v %+v", err, out)
		}
	}
}

// BenchmarkRunOnce is a per-call print(2+2) in a fresh box, back to back.
func BenchmarkRunOnce(b *testing.B)       { benchRunOnce(b, false) }
func BenchmarkRunOnceZygote(b *testing.B) { benchRunOnce(b, true) }

var _ sandbox.Backend = (*jail.Backend)(nil)
