package agent

import (
	"bytes"
	"encoding/binary"
	"io"
	"os/exec"
	"strings"
	"testing"
	"unicode/utf8"

	"kiln/internal/agentproto"
)

// richBytes is the size of a result's rich output, as MaxRich counts it.
func richBytes(res *agentproto.ExecResult) int {
	n := 0
	for _, b := range append([]agentproto.MimeBundle{res.Result}, res.Displays...) {
		for _, v := range b {
			n += len(v)
		}
	}
	return n
}

// notes gathers the notes of a result and of its bundles.
func notes(res *agentproto.ExecResult) string {
	all := strings.Join(res.Notes, "\n")
	for _, b := range append([]agentproto.MimeBundle{res.Result}, res.Displays...) {
		all += "\n" + b[agentproto.NoteMIME]
	}
	return all
}

// startAgentRaw is startAgent, but call also returns the length of the
// answer's frame as the agent wrote it.
func startAgentRaw(t *testing.T) func(agentproto.Request) (agentproto.Response, int) {
	t.Helper()
	py, err := exec.LookPath("/usr/bin/python3")
	if err != nil {
		t.Skip("needs /usr/bin/python3")
	}
	hr, aw := io.Pipe()
	ar, hw := io.Pipe()
	a := New(Config{Workspace: t.TempDir(), Python: py, UID: -1, GID: -1})
	done := make(chan error, 1)
	go func() { done <- a.Serve(ar, aw) }()
	t.Cleanup(func() { hw.Close(); <-done })
	var hello agentproto.Hello
	if err := agentproto.ReadFrame(hr, &hello); err != nil {
		t.Fatalf("reading hello: %v", err)
	}
	var id uint64
	return func(req agentproto.Request) (agentproto.Response, int) {
		id++
		req.ID = id
		if err := agentproto.WriteFrame(hw, &req); err != nil {
			t.Fatal(err)
		}
		var hdr [4]byte
		if _, err := io.ReadFull(hr, hdr[:]); err != nil {
			t.Fatal(err)
		}
		body := make([]byte, binary.BigEndian.Uint32(hdr[:]))
		if _, err := io.ReadFull(hr, body); err != nil {
			t.Fatal(err)
		}
		var resp agentproto.Response
		if err := agentproto.ReadFrame(io.MultiReader(bytes.NewReader(hdr[:]), bytes.NewReader(body)), &resp); err != nil {
			t.Fatal(err)
		}
		return resp, len(body)
	}
}

// TestAgentBounds checks that what an honest agent sends passes the host's
// validation, and that its rich output stays within MaxRich with a note
// saying what was cut, whether the driver produced it or a cell forged
// the driver's answer.
func TestAgentBounds(t *testing.T) {
	call := startAgentRaw(t)
	for _, c := range []struct {
		name, code string
		maxOutput  int
		note       string // in the notes
	}{
		{"binary output", "import os, sys\nsys.stdout.buffer.write(os.urandom(5000))\nsys.stdout.buffer.write(b'\\xe2\\x82' * 3000)", 1000, ""},
		{"html flood through display()", "class H:\n    def _repr_html_(self): return '<td>x</td>' * 100_000\nfor _ in range(12): display(H())", 0, "would take the rich output of this call over 4 MiB"},
		{"control characters everywhere", "import sys\nsys.stdout.write('\\x01' * 100_000)\nclass H:\n    def _repr_html_(self): return '\\x01' * 3_000_000\ndisplay(H())", 1000, "bytes of rich output"},
		{"a huge exception", "raise ValueError('x' * 10_000_000)", 0, "exception's text was cut"},
		{"forged driver answer", "import json, os, sys\n" +
			// The cell finds its own id in the driver's frames, as hostile code can.
			"f, cell = sys._getframe(), None\nwhile f:\n    cell = f.f_locals.get('cell') if isinstance(f.f_locals.get('cell'), str) else cell\n    f = f.f_back\n" +
			"b = {'text/html': '<b>' * 100_000, 'text/plain': 'x'}\nos.write(4, (json.dumps({'cell': cell, 'displays': [b] * 100, 'result': None, 'error': None, 'interrupted': False}) + '\\n').encode())", 0, "bytes of rich output"},
	} {
		t.Run(c.name, func(t *testing.T) {
			req := agentproto.Request{Op: agentproto.OpPython, Code: c.code, MaxOutput: c.maxOutput}
			resp, frameLen := call(req)
			req.ID = resp.ID // call numbered it
			if frameLen > req.MaxAnswer() {
				t.Errorf("a frame of %d bytes; the host reads at most %d in answer", frameLen, req.MaxAnswer())
			}
			if resp.Exec == nil {
				t.Fatalf("no result: %+v", resp)
			}
			if err := resp.Check(&req); err != nil {
				t.Fatalf("the host would refuse the agent's answer: %v", err)
			}
			res := resp.Exec
			if c.name == "a huge exception" {
				if res.Error == nil || len(res.Error.Value) > agentproto.MaxMessage+100 {
					t.Errorf("exception not cut: %+v", res.Error)
				}
				res.Error = nil
			}
			if res.Error != nil {
				t.Fatalf("the cell failed: %s", res.Error.Traceback)
			}
			for _, st := range []agentproto.Stream{res.Stdout, res.Stderr} {
				if !utf8.ValidString(st.Text) {
					t.Errorf("invalid UTF-8 in a stream")
				}
			}
			if n := richBytes(res); n > agentproto.MaxRich {
				t.Errorf("%d bytes of rich output, over MaxRich", n)
			}
			if len(res.Displays) > agentproto.MaxDisplays {
				t.Errorf("%d displays", len(res.Displays))
			}
			if c.note != "" && !strings.Contains(notes(res), c.note) {
				t.Errorf("no note %q in %q", c.note, notes(res))
			}
		})
	}
}

// TestStreamCut checks that a capped stream of arbitrary bytes keeps valid
// UTF-8 and a cut point between its head and tail.
func TestStreamCut(t *testing.T) {
	b := newCapBuf(10)
	b.Write([]byte("ab\xffc\xe2\x82"))
	b.Write([]byte(strings.Repeat("z", 100)))
	b.Write([]byte("\xe2\x82\xacend\xff"))
	st := b.Stream()
	if !utf8.ValidString(st.Text) {
		t.Errorf("invalid UTF-8: %q", st.Text)
	}
	if err := (&agentproto.Response{ID: 1, Exec: &agentproto.ExecResult{Stdout: st}}).Check(&agentproto.Request{ID: 1, Op: agentproto.OpShell, MaxOutput: 10}); err != nil {
		t.Errorf("the host would refuse it: %v", err)
	}
	if head := st.Text[:st.Cut]; !strings.HasPrefix(head, "ab") || strings.Contains(head, "z") {
		t.Errorf("cut at %d of %q", st.Cut, st.Text)
	}
}
