//lint:file-ignore SA1019 issue 15 asks for output as log messages where the client enabled logging; the SDK keeps logging working through its deprecation window (2026-07-28 revision).

package mcpserver

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// How a running call reports its output to a client that sent a progress
// token.
const (
	progressEvery = time.Second     // at most one notification a second
	progressIdle  = 5 * time.Second // and one at least this often, as a keepalive
	progressLines = 10              // the newest lines of output in each
)

// liveProgress sends notifications/progress while a run call runs, if the
// call carries a progress token: the time elapsed and the newest lines of
// its output (stdout and stderr as they interleave, at most
// agentproto.MaxLiveTail bytes). The same new output goes out as log
// messages, which the SDK sends only where the client enabled logging. A
// call without a token runs as before. stop ends the reports before the
// result is sent.
func (s *Server) liveProgress(ctx context.Context, req *mcp.CallToolRequest) (_ context.Context, stop func()) {
	if req == nil || req.Session == nil || req.Params == nil {
		return ctx, func() {}
	}
	token := req.Params.GetProgressToken()
	if token == nil {
		return ctx, func() {}
	}
	p := &progress{
		ss: req.Session, token: token, tool: req.Params.Name,
		wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{}),
	}
	go p.loop(ctx)
	return sandbox.WithOutput(ctx, p.update), func() { close(p.quit); <-p.done }
}

type progress struct {
	ss    *mcp.ServerSession
	token any
	tool  string

	mu    sync.Mutex
	out   agentproto.Output // the newest report of the box
	fresh bool              // out was not sent yet

	wake       chan struct{}
	quit, done chan struct{}
	sentTotal  int64 // output bytes already logged
}

// update keeps the box's newest report; it never blocks the reader of
// the box's frames.
func (p *progress) update(o agentproto.Output) {
	p.mu.Lock()
	p.out, p.fresh = o, true
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *progress) loop(ctx context.Context) {
	defer close(p.done)
	start := time.Now()
	last := start
	for {
		idle := time.NewTimer(time.Until(last.Add(progressIdle)))
		select {
		case <-p.quit:
			idle.Stop()
			return
		case <-ctx.Done():
			idle.Stop()
			<-p.quit
			return
		case <-p.wake:
			idle.Stop()
			if wait := time.Until(last.Add(progressEvery)); wait > 0 {
				select {
				case <-p.quit:
					return
				case <-time.After(wait):
				}
			}
		case <-idle.C:
		}
		last = time.Now()
		p.send(ctx, last.Sub(start))
	}
}

func (p *progress) send(ctx context.Context, elapsed time.Duration) {
	p.mu.Lock()
	out, fresh := p.out, p.fresh
	p.fresh = false
	p.mu.Unlock()
	msg := fmt.Sprintf("running for %s", elapsed.Round(time.Second))
	if out.Total > 0 {
		msg += fmt.Sprintf("; %d bytes of output, the newest:\n%s", out.Total, lastLines(out.Tail, progressLines))
	}
	// Progress must increase: the time elapsed, in seconds.
	p.ss.NotifyProgress(ctx, &mcp.ProgressNotificationParams{ProgressToken: p.token, Progress: elapsed.Seconds(), Message: msg})
	if !fresh || out.Total <= p.sentTotal {
		return
	}
	data := newOutput(out, p.sentTotal)
	p.sentTotal = out.Total
	// Logging is deprecated in the newest protocol revision; clients of
	// the older ones that enable it still get it.
	p.ss.Log(ctx, &mcp.LoggingMessageParams{Level: "info", Logger: "kiln." + p.tool, Data: data})
}

// newOutput is what of out came after the first sent bytes, as far as its
// tail holds it, with a note for what the tail no longer holds.
func newOutput(out agentproto.Output, sent int64) string {
	n := out.Total - sent
	if n <= int64(len(out.Tail)) {
		s := out.Tail[len(out.Tail)-int(n):]
		return strings.ToValidUTF8(s, "")
	}
	return fmt.Sprintf("[… %d bytes not shown]\n%s", n-int64(len(out.Tail)), out.Tail)
}

// lastLines is the last n lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSuffix(s, "\n"), "\n")
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
}
