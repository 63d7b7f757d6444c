package agent

import (
	"io"
	"os/exec"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"kiln/internal/agentproto"
)

// liveCall runs one request on a fresh agent and returns the Output
// frames that came before its answer, and the answer.
func liveCall(t *testing.T, req agentproto.Request) ([]agentproto.Output, agentproto.Response) {
	t.Helper()
	py, err := exec.LookPath("/usr/bin/python3")
	if err != nil {
		t.Skip("needs /usr/bin/python3")
	}
	old := liveInterval
	liveInterval = 200 * time.Millisecond
	t.Cleanup(func() { liveInterval = old })
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
	req.ID = 7
	if err := agentproto.WriteFrame(hw, &req); err != nil {
		t.Fatal(err)
	}
	var outs []agentproto.Output
	for {
		var resp agentproto.Response
		if err := agentproto.ReadFrame(hr, &resp); err != nil {
			t.Fatal(err)
		}
		if resp.ID != req.ID {
			t.Fatalf("frame for request %d, want %d", resp.ID, req.ID)
		}
		if err := resp.Check(&req); err != nil {
			t.Fatalf("the host would refuse the agent's frame: %v", err)
		}
		if resp.Output == nil {
			return outs, resp
		}
		outs = append(outs, *resp.Output)
	}
}

func TestLiveOutput(t *testing.T) {
	for _, tc := range []struct {
		op, code string
	}{
		{agentproto.OpPython, "import time, sys\nfor i in range(5):\n    print('tick', i, flush=True)\n    print('err', i, file=sys.stderr, flush=True)\n    time.sleep(0.3)"},
		{agentproto.OpShell, "for i in 0 1 2 3 4; do echo tick $i; echo err $i >&2; sleep 0.3; done"},
	} {
		t.Run(tc.op, func(t *testing.T) {
			outs, resp := liveCall(t, agentproto.Request{Op: tc.op, Code: tc.code, Live: true})
			if resp.Exec == nil || !strings.Contains(resp.Exec.Stdout.Text, "tick 4") {
				t.Fatalf("answer: %+v", resp)
			}
			if len(outs) < 2 {
				t.Fatalf("%d output frames over 1.5 s at one per 200 ms, want several", len(outs))
			}
			// Both streams feed one tail, and Python writes print's
			// pieces one by one when unbuffered, so "tick 0" may
			// arrive as "tick " and "0\n" with stderr between them.
			last := outs[len(outs)-1]
			if !strings.Contains(outs[0].Tail, "tick") || !strings.Contains(last.Tail, "err") {
				t.Fatalf("tails %q … %q", outs[0].Tail, last.Tail)
			}
			for i := 1; i < len(outs); i++ {
				if outs[i].Total <= outs[i-1].Total {
					t.Fatalf("frame %d repeats or goes back: total %d after %d", i, outs[i].Total, outs[i-1].Total)
				}
			}
		})
	}
}

func TestLiveOutputOnlyWhenAsked(t *testing.T) {
	outs, resp := liveCall(t, agentproto.Request{Op: agentproto.OpShell, Code: "for i in 1 2 3; do echo $i; sleep 0.3; done"})
	if len(outs) != 0 || resp.Exec == nil {
		t.Fatalf("%d output frames without Live; answer %+v", len(outs), resp)
	}
}

// TestLiveFlood: a call writing 5 MB, cut runes included, sends tails
// within MaxLiveTail that the host accepts.
func TestLiveFlood(t *testing.T) {
	code := "import sys, time\nfor i in range(10):\n    sys.stdout.buffer.write(('é' * 250000).encode()[1:]); sys.stdout.flush(); time.sleep(0.1)"
	outs, resp := liveCall(t, agentproto.Request{Op: agentproto.OpPython, Code: code, Live: true, MaxOutput: 1000})
	if resp.Exec == nil || len(outs) == 0 {
		t.Fatalf("%d output frames; answer %+v", len(outs), resp)
	}
	for _, o := range outs {
		if len(o.Tail) > agentproto.MaxLiveTail || !utf8.ValidString(o.Tail) || o.Tail == "" {
			t.Fatalf("tail of %d bytes (valid UTF-8: %v)", len(o.Tail), utf8.ValidString(o.Tail))
		}
	}
}

func TestLiveTailBounded(t *testing.T) {
	var l liveTail
	for i := 0; i < 1000; i++ {
		l.Write([]byte(strings.Repeat("ab", 1000)))
	}
	out, ok := l.take()
	if !ok || len(out.Tail) != agentproto.MaxLiveTail || out.Total != 2_000_000 || cap(l.buf) > 4*agentproto.MaxLiveTail {
		t.Fatalf("tail %d bytes, total %d, buffer cap %d", len(out.Tail), out.Total, cap(l.buf))
	}
	if _, ok := l.take(); ok {
		t.Fatal("a second take without new output")
	}
}
