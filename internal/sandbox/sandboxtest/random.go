package sandboxtest

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// randomDraw prints what a box draws first from each random source: the
// random module and numpy (whose state lives in the process, seeded when
// imported: in a template, if the backend restores boxes from one) and
// the kernel (os.urandom).
const randomDraw = `import json, os, random
draws = {"random": str(random.getrandbits(64)), "os.urandom": os.urandom(8).hex()}
try:
    import numpy
    draws["numpy.random"] = str(numpy.random.randint(1 << 62))
except ImportError:
    pass
print(json.dumps(draws))`

// randomPreload makes the generators part of a template where there is one.
var randomPreload = []string{"random", "numpy"}

// twoBoxesDrawDifferently checks that two boxes never share a random state:
// boxes restored from one snapshot, or forked from one zygote, start with
// the same memory and must be reseeded.
func twoBoxesDrawDifferently(t *testing.T, s *suite) {
	// A backend that starts boxes cold until its template is ready must
	// have it ready here, or the case proves nothing about templates.
	if w, ok := s.b.(sandbox.Warmer); ok {
		if err := w.Warm(s.ctx(t, 5*time.Minute), sandbox.Spec{Limits: s.opts.Limits, Preload: randomPreload}); err != nil {
			t.Fatalf("warming: %v", err)
		}
	}
	var draws [2]map[string]string
	for i := range draws {
		r := py(t, s, s.boxPreloading(t, randomPreload), randomDraw)
		if r.Error != nil {
			t.Fatalf("drawing: %+v", r.Error)
		}
		if err := json.Unmarshal([]byte(strings.TrimSpace(r.Stdout.Text)), &draws[i]); err != nil {
			t.Fatalf("drawing: %v: %q", err, r.out)
		}
	}
	for src, a := range draws[0] {
		if b := draws[1][src]; a == b {
			t.Errorf("two boxes drew the same first number from %s: %s", src, a)
		}
	}
	t.Logf("sources drawn: %d (numpy only if installed in the box)", len(draws[0]))
}
