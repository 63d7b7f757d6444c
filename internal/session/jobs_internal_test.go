package session

import (
	"context"
	"strings"
	"testing"
	"unicode/utf8"

	"kiln/internal/agentproto"
)

func testJob() *Job {
	return &Job{id: "job-t", done: make(chan struct{}), full: make(chan struct{}, 1)}
}

// TestJobUpdate: the output a poll returns is each report's new bytes
// once, whatever the box claims: totals that go back or stand still add
// nothing, a jump past the tail is counted as dropped, and the kept
// output stays valid UTF-8 and within maxPending.
func TestJobUpdate(t *testing.T) {
	j := testJob()
	j.update(agentproto.Output{Tail: "a\n", Total: 2})
	j.update(agentproto.Output{Tail: "a\nb\n", Total: 4})
	j.update(agentproto.Output{Tail: "a\nb\n", Total: 4})     // nothing new
	j.update(agentproto.Output{Tail: "forged\n", Total: 3})   // a total that goes back
	j.update(agentproto.Output{Tail: "x\n", Total: -1 << 62}) // a negative one
	j.update(agentproto.Output{Tail: "é\nc\n", Total: 8})     // 4 new bytes: "\xa9\nc\n" cut mid-rune
	st := j.Poll(context.Background(), 0)
	if st.Output != "a\nb\n\nc\n" || st.Dropped != 0 {
		t.Errorf("output %q, dropped %d", st.Output, st.Dropped)
	}
	j.update(agentproto.Output{Tail: "tail\n", Total: 1008}) // 1000 new bytes, 5 shown
	st = j.Poll(context.Background(), 0)
	if st.Output != "tail\n" || st.Dropped != 995 {
		t.Errorf("after a jump: output %q, dropped %d", st.Output, st.Dropped)
	}
	total := int64(1008)
	line := strings.Repeat("é", agentproto.MaxLiveTail/2)
	for range 3 * maxPending / len(line) {
		total += int64(len(line))
		j.update(agentproto.Output{Tail: line, Total: total})
	}
	select {
	case <-j.full:
	default:
		t.Error("a full buffer did not wake a waiting poll")
	}
	j.full <- struct{}{}
	st = j.Poll(context.Background(), 0)
	if len(st.Output) > maxPending || !utf8.ValidString(st.Output) || st.Dropped+int64(len(st.Output)) != total-1008 {
		t.Errorf("kept %d bytes (valid %v), dropped %d, of %d", len(st.Output), utf8.ValidString(st.Output), st.Dropped, total-1008)
	}
	if st := j.Poll(context.Background(), 0); st.Output != "" || st.Dropped != 0 {
		t.Errorf("a second poll returned %q again", st.Output)
	}
}
