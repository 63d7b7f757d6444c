package boxpolicy

import (
	"errors"
	"testing"
)

func TestParseUIDRange(t *testing.T) {
	for _, s := range []string{"", "5", "a-b", "0-99999999", "999-70000", "2000000-1000", "100000-100100", "1000000000-2147483647", "-1-5"} {
		if r, err := ParseUIDRange(s); err == nil {
			t.Errorf("ParseUIDRange(%q) = %v, want an error", s, r)
		}
	}
	r, err := ParseUIDRange(" 100000-199999 ")
	if err != nil || r != (UIDRange{100000, 199999}) {
		t.Fatalf("ParseUIDRange = %v, %v", r, err)
	}
	var v UIDRange
	if err := v.Set(r.String()); err != nil || v != r {
		t.Errorf("Set(%q): %v, %v", r, v, err)
	}
	if err := KubernetesUIDs.Check(); err != nil {
		t.Error(err)
	}
}

// TestDraw: a uid drawn is in the range and never one in use; a range all
// in use gives up.
func TestDraw(t *testing.T) {
	r := UIDRange{5000, 5000 + MinDrawnUIDs - 1}
	used := map[int64]bool{}
	for u := r.First; u <= r.Last; u++ {
		if u%2 != 0 { // half in use: 64 draws all missing is 2^-64
			used[u] = true
		}
	}
	inUse := func(u int64) bool { return used[u] }
	for range 200 {
		u, err := r.Draw(inUse)
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
	if _, err := r.Draw(inUse); !errors.Is(err, ErrNoUID) {
		t.Errorf("a full range: %v", err)
	}
}

// TestUIDSlots: blocks come in turn from the first one not reserved,
// wrap around to it, and lie in the range; the jail's and the microVM's
// ranges, which share a host, do not overlap, and keep the numbers the
// backends had (the jail's 4096 blocks of 65536 from 1<<30, the VMMs'
// 65536 uids right above).
func TestUIDSlots(t *testing.T) {
	s := &UIDSlots{Range: UIDRange{1000, 1000 + 4*10 - 1}, Size: 10, Reserved: 1}
	var got []int
	for range 7 {
		slot, first := s.Next()
		if first != 1000+slot*10 || first < 1000 || first+9 > 1039 {
			t.Errorf("slot %d starts at %d", slot, first)
		}
		got = append(got, slot)
	}
	if want := []int{1, 2, 3, 1, 2, 3, 1}; !equal(got, want) {
		t.Errorf("slots %v, want %v", got, want)
	}
	s = &UIDSlots{Range: UIDRange{1000, 1007}, Size: 1}
	s.Start(1<<64 - 2)
	for i, want := range []int{6, 7, 0, 1} { // a power of two: the counter wraps where the blocks do
		if slot, _ := s.Next(); slot != want {
			t.Errorf("after a random start, slot %d is %d, want %d", i, slot, want)
		}
	}
	jail := UIDSlots{Range: JailUIDs, Size: 1 << 16}
	if JailUIDs.First != 1<<30 || jail.Slots() != 4096 || VMMUIDs.First != JailUIDs.Last+1 || VMMUIDs.Len() != 1<<16 {
		t.Errorf("jail uids %v (%d slots), VMM uids %v", JailUIDs, jail.Slots(), VMMUIDs)
	}
	for _, r := range []UIDRange{JailUIDs, VMMUIDs, KubernetesUIDs} {
		if r.First < 165536 || r.Last >= 1<<31-1 {
			t.Errorf("%v: among users' or subordinate uids, or past 2^31-2", r)
		}
	}
}

func equal(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
