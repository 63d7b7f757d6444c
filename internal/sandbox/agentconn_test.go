package sandbox

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"kiln/internal/agentproto"
)

// fakeAgent serves an AgentConn over a pipe: answer says what to write for
// each request (nil: nothing).
func fakeAgent(t *testing.T, timeout time.Duration, answer func(req agentproto.Request) *agentproto.Response) (*AgentConn, <-chan struct{}) {
	t.Helper()
	host, guest := net.Pipe()
	destroyed := make(chan struct{})
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
			go func() {
				if resp := answer(req); resp != nil {
					agentproto.WriteFrame(guest, resp)
				}
			}()
		}
	}()
	c, err := DialAgent(context.Background(), "test", host, func() error { close(destroyed); return nil }, &AgentConnOptions{RequestTimeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, destroyed
}

// A caller that gives up does not make the agent's late answer a fault.
func TestAgentConnLateAnswer(t *testing.T) {
	c, destroyed := fakeAgent(t, 5*time.Second, func(req agentproto.Request) *agentproto.Response {
		if req.Path == "slow" {
			time.Sleep(300 * time.Millisecond)
		}
		return &agentproto.Response{ID: req.ID, Files: []agentproto.FileInfo{{Path: "a"}}}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := c.ListFiles(ctx, "slow"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the caller's deadline, got %v", err)
	}
	time.Sleep(500 * time.Millisecond) // the late answer arrives
	if _, err := c.ListFiles(context.Background(), "fast"); err != nil {
		t.Fatalf("after a late answer: %v", err)
	}
	select {
	case <-destroyed:
		t.Fatal("the box was destroyed for a late answer")
	default:
	}
}

// A request the agent never answers fails at the deadline, and the box is
// destroyed; so does every later call.
func TestAgentConnDeadline(t *testing.T) {
	c, destroyed := fakeAgent(t, 200*time.Millisecond, func(req agentproto.Request) *agentproto.Response { return nil })
	start := time.Now()
	_, err := c.ListFiles(context.Background(), "")
	if !errors.Is(err, ErrUnresponsive) {
		t.Fatalf("want ErrUnresponsive, got %v", err)
	}
	t.Logf("failed after %s: %v", time.Since(start).Round(time.Millisecond), err)
	select {
	case <-destroyed:
	case <-time.After(5 * time.Second):
		t.Fatal("the box was not destroyed")
	}
	select {
	case <-c.Done():
	default:
		t.Error("Done is open")
	}
	if _, _, err := c.ReadFile(context.Background(), "x", 10); !errors.Is(err, ErrUnresponsive) {
		t.Errorf("a later call: %v", err)
	}
}

// A frame that fails validation fails the call with ErrBroken and destroys
// the box.
func TestAgentConnFault(t *testing.T) {
	c, destroyed := fakeAgent(t, 5*time.Second, func(req agentproto.Request) *agentproto.Response {
		return &agentproto.Response{ID: req.ID, Exec: &agentproto.ExecResult{Stdout: agentproto.Stream{Text: "hi", Total: 5, Cut: -1}}}
	})
	_, err := c.RunPython(context.Background(), "1", ExecOptions{})
	if !errors.Is(err, ErrBroken) {
		t.Fatalf("want ErrBroken, got %v", err)
	}
	<-destroyed
	if _, err := c.RunShell(context.Background(), "true", ExecOptions{}); !errors.Is(err, ErrBroken) {
		t.Errorf("a later call: %v", err)
	}
}

// An interrupt queued behind a write the agent never reads (a stopped
// agent) still honours its context.
func TestAgentConnInterruptBehindBlockedWrite(t *testing.T) {
	host, guest := net.Pipe()
	t.Cleanup(func() { guest.Close() })
	go agentproto.WriteFrame(guest, &agentproto.Hello{Version: agentproto.Version}) // then reads nothing
	c, err := DialAgent(context.Background(), "test", host, nil, &AgentConnOptions{RequestTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	go c.RunPython(context.Background(), "1", ExecOptions{}) // its write blocks
	time.Sleep(100 * time.Millisecond)
	errc := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		errc <- c.Interrupt(ctx)
	}()
	select {
	case err := <-errc:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("want the caller's deadline, got %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Interrupt hung behind the blocked write")
	}
}
