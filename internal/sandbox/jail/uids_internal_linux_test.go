package jail

import "testing"

// TestUIDSlotsOrder: boxes get slots 1 to 4095 in turn, then 1 again
// (slot 0's first uid is the template's), each a user namespace's worth
// of host uids from 1<<30 on, as the subordinate ids of a rootless box
// are numbered (subIDs.forSlot).
func TestUIDSlotsOrder(t *testing.T) {
	s := newUIDSlots()
	for want := 1; want <= 4096; want++ {
		w := want
		if w == 4096 {
			w = 1
		}
		slot, first := s.Next()
		if slot != w || first != 1<<30+w*uidRange || first != uidBase+w*uidRange {
			t.Fatalf("box %d: slot %d from uid %d, want slot %d", want, slot, first, w)
		}
	}
}
