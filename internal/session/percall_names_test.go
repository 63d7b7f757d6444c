package session

import "testing"

// TestPrintablePath: names that print are kept; any other is Go-quoted,
// so it cannot carry escape sequences, bidi overrides or line breaks into
// a result.
func TestPrintablePath(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"out.txt", "out.txt"},
		{"sub dir/naïve – 数据.csv", "sub dir/naïve – 数据.csv"},
		{`quote"and\backslash`, `quote"and\backslash`},
		{"a\nb", `"a\nb"`},
		{"\x1b[31mred", `"\x1b[31mred"`},
		{"tab\there", `"tab\there"`},
		{"evil\u202etxt.exe", `"evil\u202etxt.exe"`},
		{"bad\xffutf8", `"bad\xffutf8"`},
		{"nul\x00", `"nul\x00"`},
	} {
		if got := printablePath(tt.in); got != tt.want {
			t.Errorf("printablePath(%q) = %s, want %s", tt.in, got, tt.want)
		}
	}
}
