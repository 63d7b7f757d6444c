package agent

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"sync"

	"kiln/internal/agentproto"
)

// ServeAttached serves hosts that attach to the agent's stream one after
// another (Kubernetes): each attach begins with agentproto.AttachMarker.
// The agent starts its kernel at once, says hello at the first marker, and
// hello again at each later one; what the earlier host left half-written
// is dropped, and answers to its requests (including live output of a call
// still running) are not sent. The kernel, its variables and the files
// stay: that is the point. It returns when r ends.
func (a *Agent) ServeAttached(r io.Reader, w io.Writer) error {
	a.w = w
	var wg sync.WaitGroup
	defer wg.Wait()
	defer a.shutdown()
	// The kernel starts and preloads now, not when the first host
	// attaches: a Pod waiting in a warm pool is ready when it is taken.
	started := make(chan *agentproto.Hello, 1)
	go func() { started <- a.start() }()
	var hello *agentproto.Hello
	for host := range splitAttaches(r) {
		if hello == nil {
			hello = <-started
		}
		a.wmu.Lock()
		a.epoch++
		err := a.sendLocked(hello)
		a.wmu.Unlock()
		if err != nil {
			return fmt.Errorf("sending hello: %w", err)
		}
		if err := a.serveFrames(host, &wg); !errors.Is(err, io.EOF) {
			a.log.Warn("host stream", "err", err)
		}
		// A frame that did not decode leaves the rest of this host's
		// stream unread until the next attach.
		io.Copy(io.Discard, host)
	}
	if hello == nil {
		<-started // so that shutdown stops the kernel it started
	}
	return nil
}

// splitAttaches cuts r at every agentproto.AttachMarker and hands on what
// follows each as a reader of its own, ended (EOF) by the next marker or by
// the end of r. What comes before the first marker is dropped.
func splitAttaches(r io.Reader) <-chan io.Reader {
	ch := make(chan io.Reader)
	go func() {
		defer close(ch)
		br := bufio.NewReaderSize(r, 64<<10)
		m := agentproto.AttachMarker
		var cur *io.PipeWriter
		out := make([]byte, 0, 64<<10)
		flush := func() {
			if cur != nil && len(out) > 0 {
				cur.Write(out) // a reader that went away drops it
			}
			out = out[:0]
		}
		matched := 0
		for {
			b, err := br.ReadByte()
			if err != nil {
				flush()
				if cur != nil {
					cur.Close()
				}
				return
			}
			switch {
			case b == m[matched]:
				matched++
				if matched == len(m) {
					matched = 0
					flush()
					if cur != nil {
						cur.Close()
					}
					var pr *io.PipeReader
					pr, cur = io.Pipe()
					ch <- pr
				}
			default:
				// The marker's first byte appears in it only there, so
				// a failed partial match holds no shorter one.
				out = append(out, m[:matched]...)
				matched = 0
				if b == m[0] {
					matched = 1
				} else {
					out = append(out, b)
				}
			}
			if br.Buffered() == 0 || len(out) >= cap(out) {
				flush()
			}
		}
	}()
	return ch
}
