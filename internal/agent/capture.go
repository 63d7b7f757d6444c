package agent

import (
	"bytes"
	"strings"
	"sync"

	"kiln/internal/agentproto"
)

// capBuf keeps the head and the tail of a stream, up to max bytes in all,
// and counts what it dropped, so a flood costs the agent bounded memory.
type capBuf struct {
	max   int
	head  []byte
	tail  []byte // ring of the last max/2 bytes once head is full
	total int64
	tee   *liveTail // also gets every byte, when the host asked for it
}

func newCapBuf(max int) *capBuf {
	if max <= 0 {
		max = defaultMaxOutput
	}
	return &capBuf{max: max}
}

func (b *capBuf) Write(p []byte) (int, error) {
	n := len(p)
	b.total += int64(n)
	b.tee.Write(p)
	headMax := b.max - b.max/2
	if room := headMax - len(b.head); room > 0 {
		k := min(room, len(p))
		b.head = append(b.head, p[:k]...)
		p = p[k:]
	}
	if len(p) > 0 {
		tailMax := b.max / 2
		b.tail = append(b.tail, p...)
		if len(b.tail) > tailMax {
			b.tail = append(b.tail[:0], b.tail[len(b.tail)-tailMax:]...)
		}
	}
	return n, nil
}

// Stream returns the kept text. When bytes were dropped, the caller (the
// host) adds the "truncated" note; Stream.Total says how many. Head and
// tail are made valid UTF-8 apart, so Cut still points between them once
// the frame is encoded (JSON would otherwise replace invalid bytes and
// move it).
func (b *capBuf) Stream() agentproto.Stream {
	head := strings.ToValidUTF8(string(b.head), "\uFFFD")
	tail := strings.ToValidUTF8(string(b.tail), "\uFFFD")
	return agentproto.Stream{Text: head + tail, Total: b.total, Cut: len(head)}
}

// demux reads one of the kernel's output pipes and splits it into cells at
// sentinels the driver writes after each cell.
type demux struct {
	mu       sync.Mutex
	cur      *capBuf
	max      int
	sentinel []byte
	carry    []byte
	done     chan *capBuf // receives the finished cell's buffer
	next     *liveTail    // tee of the buffer that starts at sentinel
}

func newDemux() *demux {
	return &demux{cur: newCapBuf(defaultMaxOutput), done: make(chan *capBuf, 1)}
}

// arm starts a cell: output up to sentinel belongs to it. Output after
// sentinel also goes to live, if not nil.
func (d *demux) arm(sentinel []byte, max int, live *liveTail) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sentinel = sentinel
	d.next = live
	d.max = max
	if d.cur.max != max {
		old := d.cur
		d.cur = newCapBuf(max)
		d.cur.Write(old.head) // output between cells goes to the next cell
		d.cur.Write(old.tail)
	}
}

func (d *demux) feed(p []byte) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sentinel == nil {
		d.cur.Write(p)
		return
	}
	data := append(d.carry, p...)
	d.carry = nil
	if i := bytes.Index(data, d.sentinel); i >= 0 {
		d.cur.Write(data[:i])
		finished := d.cur
		d.cur = newCapBuf(d.max)
		d.cur.tee, d.next = d.next, nil
		d.cur.Write(data[i+len(d.sentinel):])
		d.sentinel = nil
		select {
		case d.done <- finished:
		default:
		}
		return
	}
	keep := min(len(d.sentinel)-1, len(data))
	d.cur.Write(data[:len(data)-keep])
	d.carry = append([]byte(nil), data[len(data)-keep:]...)
}

// flush ends a cell whose sentinel will never come (the kernel died).
func (d *demux) flush() *capBuf {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cur.Write(d.carry)
	d.carry = nil
	d.sentinel = nil
	d.next = nil
	finished := d.cur
	d.cur = newCapBuf(d.max)
	return finished
}

// liveTail keeps the newest output of a running call, stdout and stderr as
// they interleave, for the Output frames the host asked for
// (Request.Live). It holds at most agentproto.MaxLiveTail bytes.
type liveTail struct {
	mu    sync.Mutex
	buf   []byte
	total int64
	sent  int64
}

// Write keeps the newest bytes of p. A nil liveTail ignores them.
func (l *liveTail) Write(p []byte) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total += int64(len(p))
	if len(p) > agentproto.MaxLiveTail {
		p = p[len(p)-agentproto.MaxLiveTail:]
	}
	l.buf = append(l.buf, p...)
	if over := len(l.buf) - agentproto.MaxLiveTail; over > 0 {
		l.buf = append(l.buf[:0], l.buf[over:]...)
	}
}

// take returns the tail if anything came since the last take. Invalid
// UTF-8 (a rune cut at either end) is dropped, so the tail stays within
// MaxLiveTail once encoded and decoded.
func (l *liveTail) take() (agentproto.Output, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.total == l.sent {
		return agentproto.Output{}, false
	}
	l.sent = l.total
	return agentproto.Output{Tail: strings.ToValidUTF8(string(l.buf), ""), Total: l.total}, true
}
