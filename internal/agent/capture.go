package agent

import (
	"bytes"
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
// host) adds the "truncated" note; Stream.Total says how many.
func (b *capBuf) Stream() agentproto.Stream {
	text := make([]byte, 0, len(b.head)+len(b.tail))
	text = append(text, b.head...)
	text = append(text, b.tail...)
	return agentproto.Stream{Text: string(text), Total: b.total, Cut: len(b.head)}
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
}

func newDemux() *demux {
	return &demux{cur: newCapBuf(defaultMaxOutput), done: make(chan *capBuf, 1)}
}

// arm starts a cell: output up to sentinel belongs to it.
func (d *demux) arm(sentinel []byte, max int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sentinel = sentinel
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
	finished := d.cur
	d.cur = newCapBuf(d.max)
	return finished
}
