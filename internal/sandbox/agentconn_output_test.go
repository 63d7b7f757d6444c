package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"kiln/internal/agentproto"
)

// scriptedAgent serves an AgentConn over a pipe: script writes whatever
// frames it likes for each request.
func scriptedAgent(t *testing.T, script func(req agentproto.Request, send func(*agentproto.Response))) (*AgentConn, <-chan struct{}) {
	t.Helper()
	host, guest := net.Pipe()
	destroyed := make(chan struct{})
	var wmu sync.Mutex
	send := func(r *agentproto.Response) {
		wmu.Lock()
		defer wmu.Unlock()
		agentproto.WriteFrame(guest, r)
	}
	go func() {
		defer guest.Close()
		if agentproto.WriteFrame(guest, &agentproto.Hello{Version: agentproto.Version}) != nil {
			return
		}
		for {
			var req agentproto.Request
			if agentproto.ReadFrame(guest, &req) != nil {
				return
			}
			go script(req, send)
		}
	}()
	c, err := DialAgent(context.Background(), "test", host, func() error { close(destroyed); return nil }, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, destroyed
}

func answer(req agentproto.Request) *agentproto.Response {
	return &agentproto.Response{ID: req.ID, Exec: &agentproto.ExecResult{Stdout: agentproto.Stream{Text: "done", Total: 4}}}
}

// A call under WithOutput asks for live output and gets each report, in
// order; one without asks for none.
func TestAgentConnOutput(t *testing.T) {
	var asked []bool
	var mu sync.Mutex
	c, destroyed := scriptedAgent(t, func(req agentproto.Request, send func(*agentproto.Response)) {
		mu.Lock()
		asked = append(asked, req.Live)
		mu.Unlock()
		if req.Live {
			for i := range 3 {
				send(&agentproto.Response{ID: req.ID, Output: &agentproto.Output{Tail: fmt.Sprintf("line %d\n", i), Total: int64(7 * (i + 1))}})
			}
		}
		send(answer(req))
	})
	var got []string
	ctx := WithOutput(context.Background(), func(o agentproto.Output) { got = append(got, o.Tail) })
	if _, err := c.RunShell(ctx, "x", ExecOptions{}); err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, "") != "line 0\nline 1\nline 2\n" {
		t.Fatalf("reports %q", got)
	}
	if _, err := c.RunPython(context.Background(), "x", ExecOptions{}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(asked) != 2 || !asked[0] || asked[1] {
		t.Fatalf("Live on the requests: %v, want [true false]", asked)
	}
	select {
	case <-destroyed:
		t.Fatal("the box was destroyed")
	default:
	}
}

// Forged output frames are faults of the box: it is destroyed and the call
// fails with ErrBroken, and kiln never hands them on.
func TestAgentConnForgedOutput(t *testing.T) {
	cases := []struct {
		name  string
		live  bool
		frame func(req agentproto.Request) *agentproto.Response
	}{
		{"unknown id", true, func(req agentproto.Request) *agentproto.Response {
			return &agentproto.Response{ID: req.ID + 100, Output: &agentproto.Output{Tail: "x", Total: 1}}
		}},
		{"not asked for", false, func(req agentproto.Request) *agentproto.Response {
			return &agentproto.Response{ID: req.ID, Output: &agentproto.Output{Tail: "x", Total: 1}}
		}},
		{"oversized tail", true, func(req agentproto.Request) *agentproto.Response {
			return &agentproto.Response{ID: req.ID, Output: &agentproto.Output{Tail: strings.Repeat("x", 1<<20), Total: 1 << 20}}
		}},
		{"with an answer", true, func(req agentproto.Request) *agentproto.Response {
			r := answer(req)
			r.Output = &agentproto.Output{}
			return r
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, destroyed := scriptedAgent(t, func(req agentproto.Request, send func(*agentproto.Response)) {
				send(tc.frame(req))
				time.Sleep(200 * time.Millisecond)
				send(answer(req))
			})
			ctx := context.Background()
			var handed int
			if tc.live {
				ctx = WithOutput(ctx, func(agentproto.Output) { handed++ })
			}
			_, err := c.RunShell(ctx, "x", ExecOptions{})
			if !errors.Is(err, ErrBroken) {
				t.Fatalf("want ErrBroken, got %v", err)
			}
			<-destroyed
			if handed != 0 {
				t.Fatalf("%d forged reports handed on", handed)
			}
		})
	}
}

// A box flooding output frames costs the server no memory beyond the
// newest report and does not keep the call from its answer.
func TestAgentConnOutputFlood(t *testing.T) {
	const frames = 20000
	c, destroyed := scriptedAgent(t, func(req agentproto.Request, send func(*agentproto.Response)) {
		tail := strings.Repeat("y", agentproto.MaxLiveTail)
		for i := range frames {
			send(&agentproto.Response{ID: req.ID, Output: &agentproto.Output{Tail: tail, Total: int64(i+1) * int64(len(tail))}})
		}
		send(answer(req))
	})
	var newest agentproto.Output
	var n int
	ctx := WithOutput(context.Background(), func(o agentproto.Output) { newest = o; n++ })
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	if _, err := c.RunShell(ctx, "x", ExecOptions{}); err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if n != frames || newest.Total != frames*agentproto.MaxLiveTail {
		t.Fatalf("%d reports, newest total %d", n, newest.Total)
	}
	grew := int64(after.HeapInuse) - int64(before.HeapInuse)
	t.Logf("%d frames of %d KiB: heap in use grew by %d KiB", frames, agentproto.MaxLiveTail>>10, grew>>10)
	if grew > 4<<20 {
		t.Fatalf("heap in use grew by %d bytes over %d output frames", grew, frames)
	}
	select {
	case <-destroyed:
		t.Fatal("the box was destroyed for honest output frames")
	default:
	}
}
