package microvm_test

import (
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/microvm"
)

// cloneProbe prints, from inside a box, what clones of one template may
// share: python's str hash seed, the libc base of the python process, the
// address of a new object; then what restore reseeds: random, numpy's
// global generator, the kernel's RNG.
const cloneProbe = `import os, random, numpy
libc = next(l.split('-')[0] for l in open('/proc/self/maps') if 'libc.so' in l)
print(hash('kiln-probe'), libc, id(object()), random.getrandbits(64), numpy.random.randint(1 << 62), os.urandom(8).hex())`

var probeFields = []string{"str hash seed", "libc base", "id(object())", "random", "numpy.random", "os.urandom"}

func probe(t *testing.T, sb sandbox.Sandbox) []string {
	t.Helper()
	f := strings.Fields(runPython(t, sb, cloneProbe))
	if len(f) != len(probeFields) {
		t.Fatalf("probe printed %q", f)
	}
	return f
}

// TestTemplateRotation measures what two clones of one template share from
// inside them, checks that what restore reseeds differs, and that after
// TemplateMaxClones clones a fresh template (booted in the background)
// serves the next clone, which shares nothing of the first.
func TestTemplateRotation(t *testing.T) {
	b := newBackend(t, microvm.Options{StateDir: t.TempDir(), TemplateMaxClones: 2})
	spec := sandbox.Spec{ID: "rot-a", Preload: []string{"numpy"}}
	a := probe(t, create(t, b, spec))
	spec.ID = "rot-b"
	c := probe(t, create(t, b, spec))
	t.Logf("clone a: %v", a)
	t.Logf("clone b: %v", c)
	for i, name := range probeFields {
		switch {
		case i < 2 && a[i] != c[i]:
			t.Errorf("clones of one template differ in %s (%s, %s): update what rotate_linux.go says they share", name, a[i], c[i])
		case i >= 3 && a[i] == c[i]:
			t.Errorf("clones of one template drew the same %s %s", name, a[i])
		}
	}
	// The second clone made the template due (3/4 of 2): its replacement
	// boots in the background.
	deadline := time.Now().Add(testTimeout)
	for microvm.Rotations(b) < 1 {
		if time.Now().After(deadline) {
			t.Fatal("no fresh template replaced the one that served 2 clones")
		}
		time.Sleep(time.Second)
	}
	spec.ID = "rot-c"
	d := probe(t, create(t, b, spec))
	t.Logf("clone c (fresh template): %v", d)
	for i, name := range probeFields {
		if i != 2 && a[i] == d[i] { // an object's address may repeat by chance
			t.Errorf("clones of two templates share %s %s", name, a[i])
		}
	}
}
