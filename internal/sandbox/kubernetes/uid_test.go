package kubernetes

import (
	"flag"
	"testing"
)

func TestUIDRange(t *testing.T) {
	for _, s := range []string{"", "5", "a-b", "0-99999999", "999-70000", "2000000-1000", "100000-100100", "1000000000-2147483647", "-1-5"} {
		if r, err := ParseUIDRange(s); err == nil {
			t.Errorf("ParseUIDRange(%q) = %v, want an error", s, r)
		}
	}
	r, err := ParseUIDRange(" 100000-199999 ")
	if err != nil || r != (UIDRange{100000, 199999}) {
		t.Fatalf("ParseUIDRange = %v, %v", r, err)
	}
	if err := DefaultUIDRange.check(); err != nil {
		t.Error(err)
	}
	var c Config
	fs := flag.NewFlagSet("kiln", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if c.Apply(Options{}).UIDs != DefaultUIDRange {
		t.Errorf("the flag's default is %v", c.UIDs)
	}
	if err := fs.Parse([]string{"-k8s-uid-range=1-2"}); err == nil {
		t.Error("a bad --k8s-uid-range is accepted")
	}
	if err := fs.Parse([]string{"-k8s-uid-range=200000-299999"}); err != nil || c.Apply(Options{}).UIDs != (UIDRange{200000, 299999}) {
		t.Errorf("--k8s-uid-range: %v, %v", c.UIDs, err)
	}
}

// TestDrawUID: a uid drawn is in the range and never one in use; a range
// all in use gives up.
func TestDrawUID(t *testing.T) {
	r := UIDRange{5000, 5000 + minUIDs - 1}
	used := map[int64]bool{}
	for u := r.First; u <= r.Last; u++ {
		if u%2 != 0 { // half in use: 64 draws all missing is 2^-64
			used[u] = true
		}
	}
	for range 200 {
		u, err := drawUID(r, used)
		if err != nil {
			t.Fatal(err)
		}
		if u < r.First || u > r.Last || used[u] {
			t.Fatalf("drew %d", u)
		}
	}
	for u := r.First; u <= r.Last; u++ {
		used[u] = true
	}
	if _, err := drawUID(r, used); err != errNoUID {
		t.Errorf("a full range: %v", err)
	}
}
