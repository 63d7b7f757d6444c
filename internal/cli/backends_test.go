package cli

import (
	"context"
	"errors"
	"flag"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/microvm"
)

// fakeBackend makes no boxes; it records Warm and Close.
type fakeBackend struct {
	warmed chan sandbox.Spec
	closed atomic.Bool
}

var _ sandbox.Warmer = (*fakeBackend)(nil)

func (b *fakeBackend) Name() string { return "fake" }

func (b *fakeBackend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	return nil, errors.New("fake backend: no boxes")
}

func (b *fakeBackend) Warm(ctx context.Context, spec sandbox.Spec) error {
	b.warmed <- spec
	return nil
}

func (b *fakeBackend) Close() error {
	b.closed.Store(true)
	return nil
}

// register adds b to the registry for the test, under b.Name().
func register(t *testing.T, b sandbox.Backend) {
	saved := registry
	t.Cleanup(func() { registry = saved })
	registry = append(slices.Clip(registry), backendEntry{
		name: b.Name(),
		flags: func(fs *flag.FlagSet) backendFactory {
			return func(ctx context.Context, env backendEnv) (sandbox.Backend, error) { return b, nil }
		},
	})
}

// TestStartWarmsBackend: a server start warms a backend that implements
// sandbox.Warmer with the spec of the boxes it will ask for, and closing
// the server closes the backend.
func TestStartWarmsBackend(t *testing.T) {
	b := &fakeBackend{warmed: make(chan sandbox.Spec, 1)}
	register(t, b)
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var c common
	c.register(fs)
	if err := fs.Parse([]string{"--backend", "fake", "--pool", "0", "--memory", "300", "--preload", "json,os"}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := c.start(ctx, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case spec := <-b.warmed:
		if spec.Limits.MemoryBytes != 300<<20 || !slices.Equal(spec.Preload, []string{"json", "os"}) {
			t.Errorf("warmed with %+v, want --memory 300 MiB and --preload json,os", spec)
		}
	case <-time.After(10 * time.Second):
		t.Error("the server started without warming its backend (sandbox.Warmer)")
	}
	st.close()
	if !b.closed.Load() {
		t.Error("closing the server did not close its backend")
	}
}

// TestRegistry: every registered backend has a distinct name, its flags
// do not collide with the common ones or another backend's (FlagSet
// panics on a redefinition), and an unknown name is refused naming them.
func TestRegistry(t *testing.T) {
	seen := map[string]bool{}
	for _, e := range registry {
		if e.name == "" || seen[e.name] {
			t.Errorf("backend name %q empty or registered twice", e.name)
		}
		seen[e.name] = true
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var c common
	c.register(fs)
	if len(c.backends) != len(registry) {
		t.Errorf("%d factories for %d backends", len(c.backends), len(registry))
	}
	_, err := c.backends.newBackend(context.Background(), "nosuch", backendEnv{})
	if err == nil || !strings.Contains(err.Error(), "jail, gvisor, microvm, firecracker, wasm, cluster or kubernetes") {
		t.Errorf("unknown backend: %v", err)
	}
}

// checkedBackend is a fake whose Check passes or fails, with a note.
type checkedBackend struct {
	fakeBackend
	name    string
	err     error
	checked atomic.Bool
}

var (
	_ sandbox.Checker = (*checkedBackend)(nil)
	_ sandbox.Noter   = (*checkedBackend)(nil)
)

func (b *checkedBackend) Name() string { return b.name }

func (b *checkedBackend) Check(ctx context.Context) error {
	b.checked.Store(true)
	return b.err
}

func (b *checkedBackend) Notes() []string { return []string{b.name + " runs with a caveat"} }

// TestDoctor: kiln doctor checks every registered backend through
// sandbox.Checker, closes it, reports each and its notes, and refuses a
// backend it cannot check.
func TestDoctor(t *testing.T) {
	good := &checkedBackend{name: "good"}
	bad := &checkedBackend{name: "bad", err: errors.New("no such thing here")}
	unchecked := &fakeBackend{}
	saved := registry
	t.Cleanup(func() { registry = saved }) // runs last
	registry = nil
	register(t, good)
	register(t, bad)
	register(t, unchecked)
	var stdout, stderr strings.Builder
	if err := runDoctor(nil, &stdout, &stderr); err != nil {
		t.Fatalf("doctor: %v\n%s", err, stderr.String())
	}
	for _, want := range []string{"good     ok\n", "bad      not available: no such thing here\n", "fake     not available: it cannot be checked"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
		}
	}
	if want := "good     note: good runs with a caveat"; !strings.Contains(stderr.String(), want) {
		t.Errorf("stderr lacks %q:\n%s", want, stderr.String())
	}
	for _, b := range []*fakeBackend{&good.fakeBackend, &bad.fakeBackend, unchecked} {
		if !b.closed.Load() {
			t.Errorf("doctor left a backend open")
		}
	}
	if !good.checked.Load() || !bad.checked.Load() {
		t.Error("doctor did not call Check")
	}
}

// TestBenchZygote: kiln bench --zygote becomes the server flag (it was an
// environment variable the jail read), and only 1 or 0 are taken.
func TestBenchZygote(t *testing.T) {
	var jailEntry backendEntry
	for _, e := range registry {
		if e.name == "jail" {
			jailEntry = e
		}
	}
	for _, tc := range []struct {
		arg  string
		want []string
		err  bool
	}{
		{"", nil, false},
		{"1", []string{"--zygote=true"}, false},
		{"0", []string{"--zygote=false"}, false},
		{"maybe", nil, true},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		args := jailEntry.benchFlags(fs)
		if err := fs.Parse([]string{"--zygote=" + tc.arg}); err != nil {
			t.Fatal(err)
		}
		got, err := args()
		if (err != nil) != tc.err || !slices.Equal(got, tc.want) {
			t.Errorf("--zygote=%s: %q, %v; want %q (error %v)", tc.arg, got, err, tc.want, tc.err)
		}
	}
}

// TestFirecrackerDoctor: the firecracker backend is in the registry, and
// its doctor check names what the host lacks before what kiln has not
// built: the firecracker binary, then /dev/kvm.
func TestFirecrackerDoctor(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("firecracker runs on Linux only")
	}
	check := func(args ...string) error {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		var c common
		c.register(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		return c.backends.checkBackend(context.Background(), "firecracker", backendEnv{}, func(string) {})
	}
	err := check("--firecracker-bin", filepath.Join(t.TempDir(), "no-firecracker"))
	if err == nil || !strings.Contains(err.Error(), "finding firecracker") || !strings.Contains(err.Error(), "--firecracker-bin") {
		t.Errorf("without a firecracker binary: %v; want it named, with the flag that names one", err)
	}
	if f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0); err == nil {
		f.Close()
		t.Skip("/dev/kvm is usable here: the next check would get past it")
	}
	fake := filepath.Join(t.TempDir(), "firecracker")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := check("--firecracker-bin", fake); !errors.Is(err, microvm.ErrNoKVM) {
		t.Errorf("with firecracker but no /dev/kvm: %v; want %v", err, microvm.ErrNoKVM)
	}
}

// TestTemplateBackendsFromRegistry: which backends make and serve
// templates is what their registry entries say, not a list of names.
func TestTemplateBackendsFromRegistry(t *testing.T) {
	saved := registry
	t.Cleanup(func() { registry = saved })
	registry = append(slices.Clip(registry),
		backendEntry{name: "maker", setupTemplate: func(context.Context, templateSetup, *network, string) (sandbox.Backend, error) {
			return &fakeBackend{}, nil
		}},
		backendEntry{name: "server", servesTemplatesOf: []string{"maker"}},
		backendEntry{name: "neither"})
	if err := checkCreateBackend("maker"); err != nil {
		t.Errorf("a backend with setupTemplate cannot make templates: %v", err)
	}
	if err := checkServeBackend("server"); err != nil || !slices.Equal(servedBy("server"), []string{"maker"}) {
		t.Errorf("a backend that serves another's templates: %v, serves %v", err, servedBy("server"))
	}
	if err := checkCreateBackend("server"); err == nil || !strings.Contains(err.Error(), "made on the maker for the server backend") {
		t.Errorf("making a template for a backend that only serves them: %v", err)
	}
	err := checkServeBackend("neither")
	if err == nil || !strings.Contains(err.Error(), "maker") || !strings.Contains(err.Error(), "server") {
		t.Errorf("a backend that neither makes nor serves templates: %v; want the ones that do named", err)
	}
	if b, err := setupBackend(context.Background(), templateSetup{backend: "maker"}, &network{}, ""); err != nil || b.Name() != "fake" {
		t.Errorf("setupBackend did not ask the maker's entry: %v", err)
	}
}
