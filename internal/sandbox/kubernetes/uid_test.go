package kubernetes

import (
	"errors"
	"flag"
	"testing"

	"kiln/internal/boxpolicy"
)

// TestUIDRange: the flag takes a range boxpolicy accepts, and defaults to
// one it accepts (boxpolicy's TestParseUIDRange has the ranges refused).
func TestUIDRange(t *testing.T) {
	if err := DefaultUIDRange.Check(); err != nil {
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
	if err := fs.Parse([]string{"-k8s-uid-range=200000-299999"}); err != nil || c.Apply(Options{}).UIDs != (UIDRange{First: 200000, Last: 299999}) {
		t.Errorf("--k8s-uid-range: %v, %v", c.UIDs, err)
	}
}

// TestDrawUID: a uid drawn is never one of the boxes in use (the draw
// itself is boxpolicy's, TestDraw); a range all in use gives up, saying so.
func TestDrawUID(t *testing.T) {
	r := UIDRange{First: 5000, Last: 5001}
	for range 20 { // 64 draws all hitting 5000 is 2^-64
		if u, err := drawUID(r, map[int64]bool{5000: true}); err != nil || u != 5001 {
			t.Fatalf("drew %d, %v; want the one free uid, 5001", u, err)
		}
	}
	if _, err := drawUID(r, map[int64]bool{5000: true, 5001: true}); !errors.Is(err, boxpolicy.ErrNoUID) || err.Error() != "kubernetes: no free uid in the boxes' uid range" {
		t.Errorf("a full range: %v", err)
	}
}
