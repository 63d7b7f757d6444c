package egress

import (
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
)

// Bounds on what one box can make the gateway hold or write.
const (
	// maxNameLen is the longest DNS name (RFC 1035: 255 octets on the
	// wire, 253 characters written out). Longer names are refused before
	// anything logs them.
	maxNameLen = 253
	// maxReasonLen bounds a refusal's reason, which can quote what the
	// box sent.
	maxReasonLen = 300
	// logBurst refusals of one box are logged in full per logWindow; the
	// rest are counted and summarized in one line.
	logBurst  = 20
	logWindow = 10 * time.Second
	// maxRefusing bounds the connections being refused at once (answer
	// written, a little input drained); beyond it they are just closed.
	maxRefusing = 64
	// proxyIdleTimeout bounds how long the proxy keeps a box's HTTP
	// connection open between requests.
	proxyIdleTimeout = 60 * time.Second
)

// boxConn is a connection a box opened to one of the gateway's listeners.
// It holds one of the box's connection slots until it is closed, and it
// closes itself when no byte has moved for ConnIdleTimeout or when it is
// ConnMaxLifetime old.
type boxConn struct {
	net.Conn
	c     *core
	att   *Attachment
	last  atomic.Int64 // UnixNano of the last byte read or written
	close sync.Once

	tmu    sync.Mutex // guards the timers
	idle   *time.Timer
	life   *time.Timer
	closed bool
}

// startTimers arms the idle and lifetime limits.
func (b *boxConn) startTimers() {
	b.tmu.Lock()
	defer b.tmu.Unlock()
	b.idle = time.AfterFunc(b.c.opts.ConnIdleTimeout, b.checkIdle)
	b.life = time.AfterFunc(b.c.opts.ConnMaxLifetime, func() {
		b.c.log.Debug("egress connection reached its lifetime, closed", "session", b.att.session)
		b.Close()
	})
}

func (b *boxConn) stopTimers() {
	b.tmu.Lock()
	defer b.tmu.Unlock()
	b.closed = true
	if b.idle != nil {
		b.idle.Stop()
		b.life.Stop()
	}
}

func (b *boxConn) Read(p []byte) (int, error) {
	n, err := b.Conn.Read(p)
	if n > 0 {
		b.last.Store(time.Now().UnixNano())
	}
	return n, err
}

func (b *boxConn) Write(p []byte) (int, error) {
	n, err := b.Conn.Write(p)
	if n > 0 {
		b.last.Store(time.Now().UnixNano())
	}
	return n, err
}

func (b *boxConn) CloseWrite() error {
	if cw, ok := b.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// Close releases the box's slot and closes the connection.
func (b *boxConn) Close() error {
	b.close.Do(func() {
		b.stopTimers()
		b.c.release(b)
	})
	return b.Conn.Close()
}

// checkIdle closes b if it has been idle for the idle timeout, or else
// looks again when it would be.
func (b *boxConn) checkIdle() {
	idle := time.Since(time.Unix(0, b.last.Load()))
	if left := b.c.opts.ConnIdleTimeout - idle; left > 0 {
		b.tmu.Lock()
		if !b.closed {
			b.idle.Reset(left)
		}
		b.tmu.Unlock()
		return
	}
	b.c.log.Debug("egress connection idle, closed", "session", b.att.session, "idle", idle.Round(time.Millisecond).String())
	b.Close()
}

// admit takes a slot for conn, a connection accepted on a listener of the
// gateway, and returns it wrapped; nil if conn is from no attached box or
// over a limit (then conn is refused and closed). via says which listener.
func (c *core) admit(conn net.Conn, via string, port uint16) *boxConn {
	a := c.boxAt(conn.RemoteAddr())
	if a == nil {
		conn.Close()
		return nil
	}
	c.mu.RLock()
	boxes := max(len(c.boxes), 1)
	c.mu.RUnlock()
	share := max(c.opts.MaxConns/boxes, 1)

	b := &boxConn{Conn: conn, c: c, att: a}
	b.last.Store(time.Now().UnixNano())
	b.startTimers()
	var victim *boxConn
	var victimHeld int
	reason := ""
	c.lim.Lock()
	held := len(a.slots)
	switch {
	case a.slotsClosed:
		reason = "the sandbox is detached"
	case held >= c.opts.MaxConnsPerBox:
		reason = fmt.Sprintf("the sandbox has %d open connections through the gateway, its limit; close some first", held)
	case c.total >= c.opts.MaxConns && held >= share:
		reason = fmt.Sprintf("the gateway holds its limit of %d connections and the sandbox has %d open, its share; close some first", c.total, held)
	case c.total >= c.opts.MaxConns:
		victim, victimHeld = c.evictLocked(a)
		if victim == nil {
			reason = fmt.Sprintf("the gateway holds its limit of %d connections", c.total)
		}
	}
	if reason == "" {
		if a.slots == nil {
			a.slots = map[*boxConn]struct{}{}
		}
		a.slots[b] = struct{}{}
		c.total++
	}
	c.lim.Unlock()

	if victim != nil {
		c.refuse(victim.att, Refusal{Via: "limit", Reason: fmt.Sprintf(
			"closed its least recently used connection: the gateway holds its limit of %d connections and the sandbox had %d open, more than its share of %d", c.opts.MaxConns, victimHeld, share)})
		victim.Close()
	}
	if reason != "" {
		b.stopTimers()
		c.refuse(a, Refusal{Via: via, Port: port, Reason: reason})
		c.refuseConn(conn, via, http503, reason)
		return nil
	}
	return b
}

// evictLocked takes the least recently active connection from the box,
// other than a, that holds the most, and returns it; the caller closes
// it. c.lim is held.
func (c *core) evictLocked(a *Attachment) (*boxConn, int) {
	c.mu.RLock()
	var hog *Attachment
	for _, o := range c.boxes {
		if o != a && (hog == nil || len(o.slots) > len(hog.slots)) {
			hog = o
		}
	}
	c.mu.RUnlock()
	if hog == nil || len(hog.slots) == 0 {
		return nil, 0
	}
	var victim *boxConn
	for s := range hog.slots {
		if victim == nil || s.last.Load() < victim.last.Load() {
			victim = s
		}
	}
	held := len(hog.slots)
	delete(hog.slots, victim)
	c.total--
	return victim, held
}

// release frees b's slot, unless an eviction already took it.
func (c *core) release(b *boxConn) {
	c.lim.Lock()
	defer c.lim.Unlock()
	if _, ok := b.att.slots[b]; ok {
		delete(b.att.slots, b)
		c.total--
	}
}

// closeSlots closes every connection a holds and admits no more.
func (c *core) closeSlots(a *Attachment) {
	c.lim.Lock()
	slots := a.slots
	a.slots = nil
	a.slotsClosed = true
	c.total -= len(slots)
	c.lim.Unlock()
	for b := range slots {
		b.Close()
	}
}

// Statuses of the HTTP answer to a refused connection.
const (
	http403 = "403 Forbidden"
	http503 = "503 Service Unavailable"
)

// refuseConn answers a connection the gateway will not serve and closes
// it, off the caller's goroutine. via is the listener: on the proxy port
// the answer is HTTP; on a transparent port one byte is read first to
// tell TLS from HTTP; DNS gets no answer. A little of what the box sent
// is drained, so the close does not reset the connection before the box
// has read the answer.
func (c *core) refuseConn(conn net.Conn, via, status, msg string) {
	if via == "dns" {
		conn.Close()
		return
	}
	select {
	case c.refusing <- struct{}{}:
	default:
		conn.Close()
		return
	}
	go func() {
		defer func() { <-c.refusing }()
		defer conn.Close()
		isTLS := false
		if via != "proxy" {
			var b [1]byte
			conn.SetReadDeadline(time.Now().Add(time.Second))
			if n, _ := conn.Read(b[:]); n == 1 {
				isTLS = b[0] == 22
			}
		}
		refuseStream(conn, isTLS, status, msg)
		closeWrite(conn)
		conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		io.Copy(io.Discard, io.LimitReader(conn, 64<<10))
	}()
}

// logLimiter lets a box log logBurst refusals per logWindow and counts
// the rest.
type logLimiter struct {
	mu         sync.Mutex
	start      time.Time
	logged     int
	suppressed int
}

// allow reports whether a refusal at now may be logged, and how many were
// suppressed in the window that has just ended (to be summarized).
func (l *logLimiter) allow(now time.Time) (ok bool, flushed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.start) >= logWindow {
		flushed = l.suppressed
		l.start, l.logged, l.suppressed = now, 0, 0
	}
	if l.logged < logBurst {
		l.logged++
		return true, flushed
	}
	l.suppressed++
	return false, flushed
}

// flush returns the count not yet summarized and forgets it.
func (l *logLimiter) flush() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := l.suppressed
	l.suppressed = 0
	return n
}

// clip bounds s to n bytes, cutting on a character boundary and saying
// how long it was.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s… (%d bytes)", s[:cut], len(s))
}
