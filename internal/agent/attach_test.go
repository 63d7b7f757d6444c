package agent

import (
	"bytes"
	"encoding/json"
	"io"
	"os/exec"
	"strings"
	"testing"
	"time"

	"kiln/internal/agentproto"
)

// TestServeAttached: a second host attaches after the first left a frame
// half-written and a call running. It gets a hello, the kernel's state,
// and nothing of the first host's call.
func TestServeAttached(t *testing.T) {
	py, err := exec.LookPath("/usr/bin/python3")
	if err != nil {
		t.Skip("needs /usr/bin/python3")
	}
	hr, aw := io.Pipe()
	ar, hw := io.Pipe()
	a := New(Config{Workspace: t.TempDir(), Python: py, UID: -1, GID: -1})
	done := make(chan error, 1)
	go func() { done <- a.ServeAttached(ar, aw) }()
	t.Cleanup(func() { hw.Close(); hr.Close(); <-done })

	frames := make(chan map[string]json.RawMessage, 64)
	go func() {
		for {
			var f map[string]json.RawMessage
			if err := agentproto.ReadFrame(hr, &f); err != nil {
				close(frames)
				return
			}
			frames <- f
		}
	}()
	next := func() map[string]json.RawMessage {
		t.Helper()
		select {
		case f, ok := <-frames:
			if !ok {
				t.Fatal("the agent's stream ended")
			}
			return f
		case <-time.After(30 * time.Second):
			t.Fatal("no frame from the agent")
		}
		return nil
	}
	send := func(req agentproto.Request) {
		t.Helper()
		if err := agentproto.WriteFrame(hw, &req); err != nil {
			t.Fatal(err)
		}
	}
	write := func(b []byte) {
		t.Helper()
		if _, err := hw.Write(b); err != nil {
			t.Fatal(err)
		}
	}

	// Bytes before any attach are nobody's.
	write([]byte("noise"))
	write(agentproto.AttachMarker)
	if f := next(); f["version"] == nil || f["id"] != nil {
		t.Fatalf("first frame is not a hello: %v", f)
	}
	send(agentproto.Request{ID: 1, Op: agentproto.OpPython, Code: "x = 41"})
	if f := next(); string(f["id"]) != "1" {
		t.Fatalf("answer to 1: %v", f)
	}
	// Host one: a slow call with live output, then half a frame, then it
	// is gone.
	send(agentproto.Request{ID: 2, Op: agentproto.OpShell, Code: "for i in 1 2 3 4 5 6; do echo tick; sleep 0.5; done; echo OLD-DONE", Live: true})
	time.Sleep(700 * time.Millisecond)
	var half bytes.Buffer
	agentproto.WriteFrame(&half, &agentproto.Request{ID: 3, Op: agentproto.OpPython, Code: "x = 0"})
	write(half.Bytes()[:half.Len()/2])

	// Host two.
	write(agentproto.AttachMarker)
	for {
		f := next()
		if f["version"] != nil && f["id"] == nil {
			break // its hello; frames before it may still be host one's
		}
	}
	send(agentproto.Request{ID: 1, Op: agentproto.OpPython, Code: "x + 1"})
	deadline := time.After(4 * time.Second) // host one's call ends within it
	got42 := false
	for {
		select {
		case f, ok := <-frames:
			if !ok {
				t.Fatal("the agent's stream ended")
			}
			if string(f["id"]) != "1" {
				t.Errorf("host two got a frame of host one: %v", f)
				continue
			}
			if strings.Contains(string(f["exec"]), "42") {
				got42 = true
			}
		case <-deadline:
			if !got42 {
				t.Error("host two did not get the kernel's state (x + 1 == 42)")
			}
			return
		}
	}
}

// TestSplitAttachesKeepsFrames: frames whose bytes look like the start of
// the marker pass through whole.
func TestSplitAttachesKeepsFrames(t *testing.T) {
	var in bytes.Buffer
	in.Write(agentproto.AttachMarker)
	want := []byte{0, 1, 2, 3, 'x', 0, 1, 0}
	in.Write(want)
	in.Write(agentproto.AttachMarker)
	in.WriteString("second")
	var got []string
	for r := range splitAttaches(&in) {
		b, _ := io.ReadAll(r)
		got = append(got, string(b))
	}
	if len(got) != 2 || got[0] != string(want) || got[1] != "second" {
		t.Errorf("got %q", got)
	}
}
