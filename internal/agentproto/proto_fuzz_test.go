package agentproto

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// FuzzReadFrame feeds the decoder what a hostile box could put on its end
// of the stream. It must never panic, must refuse frames over MaxFrame, and
// whatever it accepts must survive a round trip unchanged.
func FuzzReadFrame(f *testing.F) {
	f.Add([]byte("\x00\x00\x00\x02{}"))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		var resp Response
		err := ReadFrame(r, &resp)
		if len(data) >= 4 && binary.BigEndian.Uint32(data) > MaxFrame && !errors.Is(err, ErrFrameTooLarge) {
			t.Fatalf("a frame announcing %d bytes: %v", binary.BigEndian.Uint32(data), err)
		}
		if err == nil {
			roundTrip(t, &resp, new(Response))
		}
		var req Request
		if ReadFrame(bytes.NewReader(data), &req) == nil {
			roundTrip(t, &req, new(Request))
		}
		var hello Hello
		if ReadFrame(bytes.NewReader(data), &hello) == nil {
			roundTrip(t, &hello, new(Hello))
		}
		// The rest of the stream decodes frame after frame until an
		// error; it must end.
		for i := 0; ReadFrame(r, &resp) == nil; i++ {
			if i > len(data) {
				t.Fatalf("more frames than bytes")
			}
		}
	})
}

func roundTrip[T any](t *testing.T, v *T, back *T) {
	t.Helper()
	var buf bytes.Buffer
	if err := WriteFrame(&buf, v); err != nil {
		if errors.Is(err, ErrFrameTooLarge) {
			return
		}
		t.Fatalf("re-encoding an accepted frame: %v", err)
	}
	if err := ReadFrame(&buf, back); err != nil {
		t.Fatalf("decoding a re-encoded frame: %v", err)
	}
	if diff := cmp.Diff(v, back); diff != "" {
		t.Fatalf("round trip changed the frame (-first +second):\n%s", diff)
	}
}
