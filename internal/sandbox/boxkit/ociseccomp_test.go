package boxkit

import (
	"slices"
	"testing"

	"kiln/internal/boxpolicy"
)

// TestComplement: the compares hold for exactly the arguments whose bits
// under the mask are none of the values, whatever the other bits are, and
// no two hold at once.
func TestComplement(t *testing.T) {
	for _, c := range []struct {
		mask   uint64
		values []uint64
	}{
		{0xff, []uint64{3, 7, 200}},
		{0xf0, []uint64{0}},
		{boxpolicy.Low32, boxpolicy.DeniedIoctls},
	} {
		checks := complement(c.mask, c.values)
		probes := []uint64{0, 1 << 40, ^uint64(0)}
		for v := range uint64(256) {
			probes = append(probes, v, v|0xdead<<32, v<<8)
		}
		probes = append(probes, c.values...)
		for _, v := range c.values {
			probes = append(probes, v|^c.mask, v^1, v+1<<20)
		}
		for _, a := range probes {
			n := 0
			for _, k := range checks {
				if a&k.Mask == k.Value {
					n++
				}
			}
			if want := !slices.Contains(c.values, a&c.mask); n != map[bool]int{false: 0, true: 1}[want] {
				t.Errorf("mask %#x values %#x: %#x matches %d compares, want one only if it is none of the values", c.mask, c.values, a, n)
			}
		}
	}
}
