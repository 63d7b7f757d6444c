package jail_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"sort"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// probeShared reads, from inside a box, every value two boxes forked from
// one zygote template could have in common: where libc, the heap and the
// main stack are mapped, the address of None, the string-hash seed, the
// state of random and of numpy's global generator, a fresh os.urandom
// draw, and the two secrets glibc keeps in the thread control block (on
// x86-64 the TCB is pthread_self(), the %fs base): the stack canary at
// fs:0x28 (from AT_RANDOM) and the pointer guard at fs:0x30. Reading them
// needs no syscall, so the seccomp filter does not stand in the way.
const probeShared = `
import ctypes, json, os, random
import numpy

def _base(pred):
    for line in open("/proc/self/maps"):
        if pred(line):
            return line.split("-", 1)[0]
    return None

_libc = ctypes.CDLL(None)
_libc.pthread_self.restype = ctypes.c_void_p
_tcb = _libc.pthread_self()
json.dumps({
    "libc base": _base(lambda l: "/libc.so" in l or "/libc-" in l),
    "heap base": _base(lambda l: l.rstrip().endswith("[heap]")),
    "stack": _base(lambda l: l.rstrip().endswith("[stack]")),
    "id(None)": hex(id(None)),
    "hash(str)": str(hash("kiln zygote")),
    "stack canary": hex(ctypes.c_uint64.from_address(_tcb + 0x28).value),
    "pointer guard": hex(ctypes.c_uint64.from_address(_tcb + 0x30).value),
    "random": str(random.getrandbits(64)),
    "numpy.random": str(numpy.random.randint(1 << 62)),
    "os.urandom": os.urandom(8).hex(),
})
`

// zygoteShared is what two boxes of one template have in common, exactly
// (docs/backends/jail.md, "What zygote boxes share"). Everything else probeShared reads
// differs between them.
//
// id(None) is an address inside the python3 executable; Debian's is not
// position-independent, so it is the same in every python3 on the host,
// zygote or not, and no template rotation changes it.
var zygoteShared = []string{
	"hash(str)",
	"heap base",
	"id(None)",
	"libc base",
	"pointer guard",
	"stack",
	"stack canary",
}

func probe(ctx context.Context, t *testing.T, box sandbox.Sandbox) map[string]any {
	t.Helper()
	res, err := box.RunPython(ctx, probeShared, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Error != nil {
		t.Fatalf("probe: %+v %s", res.Error, res.Stderr.Text)
	}
	var text string
	if err := json.Unmarshal([]byte(res.Result["text/plain"]), &text); err != nil {
		// The repr of a str: single-quoted; JSON inside has no quotes of that kind.
		text = strings.Trim(res.Result["text/plain"], "'")
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(text), &m); err != nil {
		t.Fatalf("probe result %q: %v", res.Result["text/plain"], err)
	}
	for k, v := range m {
		if v == nil {
			t.Fatalf("probe could not read %q: %s", k, text)
		}
	}
	return m
}

// shared lists the probed values a and b have in common.
func shared(a, b map[string]any) []string {
	var out []string
	for k, v := range a {
		if b[k] == v {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

func newRotatingBackend(t *testing.T, opts jail.Options) *jail.Backend {
	t.Helper()
	if testing.Short() {
		t.Skip("starts several zygote templates")
	}
	b := newZygoteBackend(t) // skips without root; only for its checks
	b.Close()
	opts.Agent = sandboxtest.BuildAgent(t)
	opts.Zygote = true
	opts.Logger = slog.New(failOnWarn{t})
	b, err := jail.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// TestZygoteShared measures what two boxes of one template share, from
// inside each, and holds it to zygoteShared: a value that becomes shared
// (a generator no longer reseeded) or stops being shared fails here.
func TestZygoteShared(t *testing.T) {
	b := newRotatingBackend(t, jail.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var probes []map[string]any
	for _, id := range []string{"share-a", "share-b"} {
		box, err := b.Create(ctx, sandbox.Spec{ID: id, Preload: []string{"numpy"}})
		if err != nil {
			t.Fatal(err)
		}
		defer box.Close()
		probes = append(probes, probe(ctx, t, box))
	}
	got := shared(probes[0], probes[1])
	t.Logf("box a: %v", probes[0])
	t.Logf("box b: %v", probes[1])
	t.Logf("shared: %v", got)
	if strings.Join(got, ",") != strings.Join(zygoteShared, ",") {
		t.Errorf("boxes of one template share %v, want exactly %v", got, zygoteShared)
	}
}

// TestZygoteRotation: with MaxBoxes small, a template serves that many
// boxes and the ones after come from a fresh template, whose addresses and
// secrets differ from the first; and no call waits for a template to start
// once the first one is warm.
func TestZygoteRotation(t *testing.T) {
	const n = 2
	b := newRotatingBackend(t, jail.Options{ZygoteMaxBoxes: n})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	spec := sandbox.Spec{Preload: []string{"numpy"}}
	var probes []map[string]any
	var boxes []sandbox.Sandbox
	create := func(id string) {
		spec.ID = id
		box, err := b.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { box.Close() })
		boxes = append(boxes, box)
		probes = append(probes, probe(ctx, t, box))
	}
	for i := range n {
		create("rot-first-" + string(rune('a'+i)))
	}
	// The replacement starts in the background; it is ready long before
	// a real template serves its last box. Here, wait for it.
	if err := jail.WaitZygoteRotation(ctx, b, 1); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		create("rot-second-" + string(rune('a'+i)))
	}
	if got := shared(probes[0], probes[1]); len(got) != len(zygoteShared) {
		t.Errorf("boxes 1 and 2 (one template) share %v, want %v", got, zygoteShared)
	}
	if got := shared(probes[n], probes[n+1]); len(got) != len(zygoteShared) {
		t.Errorf("boxes 3 and 4 (one template) share %v, want %v", got, zygoteShared)
	}
	for _, k := range []string{"libc base", "heap base", "stack", "stack canary", "pointer guard", "hash(str)"} {
		if probes[0][k] == probes[n][k] {
			t.Errorf("box %d shares %s with box 1 (%v): it came from the first template", n+1, k, probes[0][k])
		}
	}
	// The first template is retired, not killed: its boxes live in a pid
	// namespace nested in its own and would die with it.
	if res, err := boxes[0].RunShell(ctx, "echo alive", sandbox.ExecOptions{}); err != nil || strings.TrimSpace(res.Stdout.Text) != "alive" {
		t.Errorf("box 1 after its template was replaced: %v %+v", err, res)
	}
	st := jail.ZygoteStatsOf(b)
	t.Logf("template lifecycle: %+v", st)
	if st.SyncStarts != 1 {
		t.Errorf("calls started %d templates themselves, want 1 (only the first, cold one)", st.SyncStarts)
	}
	if st.Waits != 1 {
		t.Errorf("%d calls waited for a template to become ready, want 1 (the first)", st.Waits)
	}
	if st.Rotations < 1 {
		t.Errorf("no template was replaced after %d boxes", 2*n)
	}
}

// TestZygoteRotationByAge: a template older than MaxAge is replaced in
// the background, with no call.
func TestZygoteRotationByAge(t *testing.T) {
	b := newRotatingBackend(t, jail.Options{ZygoteMaxAge: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "age-a"})
	if err != nil {
		t.Fatal(err)
	}
	first := probeCanary(ctx, t, box)
	box.Close()
	if err := jail.WaitZygoteRotation(ctx, b, 1); err != nil {
		t.Fatal(err)
	}
	box, err = b.Create(ctx, sandbox.Spec{ID: "age-b"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	if second := probeCanary(ctx, t, box); first == second {
		t.Errorf("a box after MaxAge shares its stack canary %s with the first template's", first)
	}
	if st := jail.ZygoteStatsOf(b); st.SyncStarts != 1 || st.Waits != 1 {
		t.Errorf("the call path started or waited for a template: %+v", st)
	}
}

func probeCanary(ctx context.Context, t *testing.T, box sandbox.Sandbox) string {
	res, err := box.RunPython(ctx, "import ctypes; l = ctypes.CDLL(None); l.pthread_self.restype = ctypes.c_void_p; hex(ctypes.c_uint64.from_address(l.pthread_self() + 0x28).value)", sandbox.ExecOptions{})
	if err != nil || res.Error != nil {
		t.Fatalf("%v %+v", err, res)
	}
	return res.Result["text/plain"]
}
