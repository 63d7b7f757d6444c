package bench

import "testing"

func TestAccelOf(t *testing.T) {
	for _, c := range []struct {
		backend string
		args    []string
		want    string
	}{
		{"jail", []string{"--accel", "tcg"}, ""},
		{"microvm", nil, "kvm"},
		{"microvm", []string{"--pool", "1", "--accel", "tcg"}, "tcg"},
		{"microvm", []string{"-accel=tcg"}, "tcg"},
	} {
		if got := accelOf(c.backend, c.args); got != c.want {
			t.Errorf("accelOf(%q, %q) = %q, want %q", c.backend, c.args, got, c.want)
		}
	}
}
