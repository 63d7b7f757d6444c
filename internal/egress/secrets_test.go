package egress

import (
	"io"
	"strings"
	"testing"
	"testing/iotest"
)

// TestScrubReaderAcrossReads: a value split over any number of reads of
// the body is still replaced, and nothing else changes.
func TestScrubReaderAcrossReads(t *testing.T) {
	t.Setenv("KILN_TEST_SCRUB", "s3cr3t-v4lue")
	s := Secret{Name: "TOKEN", Host: "api.test", Env: "KILN_TEST_SCRUB"}
	if err := s.check(); err != nil {
		t.Fatal(err)
	}
	sc, err := newScrubber([]*Secret{&s})
	if err != nil {
		t.Fatal(err)
	}
	body := "a s3cr3t-v4lue b s3cr3t-v4lues3cr3t-v4lue s3cr3t-v4lu end s3cr3t-v4lue"
	want := strings.ReplaceAll(body, "s3cr3t-v4lue", s.Placeholder())
	for name, r := range map[string]io.Reader{
		"whole":    strings.NewReader(body),
		"one byte": iotest.OneByteReader(strings.NewReader(body)),
		"halves":   iotest.HalfReader(strings.NewReader(body)),
	} {
		got, err := io.ReadAll(&scrubReader{sc: sc, r: io.NopCloser(r)})
		if err != nil || string(got) != want {
			t.Errorf("%s: %q, %v; want %q", name, got, err, want)
		}
	}
}
