package jail_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

func newZygoteBackend(t testing.TB) *jail.Backend {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("the jail tests need root (user namespaces with a uid range, cgroups)")
	}
	// A box the zygote could not make is made directly, with a warning:
	// here that is a failure.
	log := slog.New(failOnWarn{t})
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t), Zygote: true, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// failOnWarn fails the test on every warning the backend logs.
type failOnWarn struct{ t testing.TB }

func (h failOnWarn) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }
func (h failOnWarn) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	h.t.Errorf("backend warned: %s%s", r.Message, b.String())
	return nil
}
func (h failOnWarn) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h failOnWarn) WithGroup(string) slog.Handler      { return h }

// TestConformanceZygote runs the whole contract against forked boxes.
func TestConformanceZygote(t *testing.T) {
	sandboxtest.RunWith(t, newZygoteBackend(t), sandboxtest.Options{HostProcesses: true})
}

// TestZygoteBoxes checks what only forked boxes could get wrong: each has
// its own uid range, sees neither the template nor another box, holds no
// privilege, and draws its own random numbers.
func TestZygoteBoxes(t *testing.T) {
	b := newZygoteBackend(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec := sandbox.Spec{Preload: []string{"numpy"}}
	var boxes []sandbox.Sandbox
	for _, id := range []string{"zy-a", "zy-b"} {
		spec.ID = id
		box, err := b.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		defer box.Close()
		boxes = append(boxes, box)
	}
	probe := func(box sandbox.Sandbox) string {
		res, err := box.RunShell(ctx, `cat /proc/self/uid_map; grep -E '^(CapEff|CapBnd|CapInh|NoNewPrivs|Seccomp):' /proc/self/status; ls -d /proc/[0-9]* | wc -l; cat /proc/[0-9]*/cmdline | tr '\0' ' '; ls -a /work`, sandbox.ExecOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return res.Stdout.Text
	}
	a, c := probe(boxes[0]), probe(boxes[1])
	for _, want := range []string{"CapEff:\t0000000000000000", "CapBnd:\t0000000000000000", "CapInh:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"} {
		if !strings.Contains(a, want) {
			t.Errorf("missing %q in:\n%s", want, a)
		}
	}
	if strings.Contains(a, "zygote") || strings.Contains(a, "__kiln_jail") {
		t.Errorf("the template is visible in a box:\n%s", a)
	}
	mapA, mapC := strings.SplitN(a, "\n", 2)[0], strings.SplitN(c, "\n", 2)[0]
	if mapA == mapC {
		t.Errorf("two forked boxes share a uid range: %q", mapA)
	}
	var draws []string
	for _, box := range boxes {
		res, err := box.RunPython(ctx, "import numpy, random; (numpy.random.randint(1 << 30), random.getrandbits(30))", sandbox.ExecOptions{})
		if err != nil || res.Error != nil {
			t.Fatalf("%v %+v", err, res)
		}
		draws = append(draws, res.Result["text/plain"])
	}
	if draws[0] == draws[1] {
		t.Errorf("two forked boxes drew the same random numbers: %s", draws[0])
	}
}
