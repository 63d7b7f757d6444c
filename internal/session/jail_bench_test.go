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
