package cluster

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// NodeOptions configure a Node.
type NodeOptions struct {
	// Backend makes the node's boxes; its boxes must host kiln-agent
	// (the jail, gVisor, a microVM).
	Backend sandbox.Backend
	// TLS is the node's server configuration (NodeTLS).
	TLS *tls.Config
	// Limits are the most a box may have; a front asking for more, or
	// for nothing, gets these.
	Limits sandbox.Limits
	// Preload is what the node's boxes import ahead: the node's, whatever
	// a front would like, so that one template serves every front.
	Preload []string
	// MaxBoxes caps the node's live boxes; a front asking for one more
	// is refused and places the box elsewhere. It must be set.
	MaxBoxes int
	Logger   *slog.Logger
	// HandshakeTimeout bounds a connection's TLS handshake and Open
	// frame (default 10 s); CreateTimeout the making of its box (2 min).
	HandshakeTimeout time.Duration
	CreateTimeout    time.Duration
	// MaxPending caps the connections whose front has not yet shown its
	// certificate and first frame (default 64): past it a connection is
	// closed at once, so that whoever reaches the port cannot hold the
	// node's memory with handshakes it never finishes.
	MaxPending int
	// OrphanGrace is how long a box bound to a session is kept after its
	// front's connection ends without unbinding it (a front killed or cut
	// off), for another front to adopt (default DefaultOrphanGrace; a
	// negative value destroys it at once). It counts against MaxBoxes
	// meanwhile.
	OrphanGrace time.Duration
}

// DefaultMaxPending is NodeOptions.MaxPending's default.
const DefaultMaxPending = 64

// DefaultOrphanGrace is NodeOptions.OrphanGrace's default: time for a
// client to reach another front, as twice a Kubernetes replica's Lease
// gives on that backend.
const DefaultOrphanGrace = time.Minute

// Node serves a local backend's boxes to fronts (kiln node).
type Node struct {
	o    NodeOptions
	log  *slog.Logger
	name string // Status.Node

	mu     sync.Mutex
	boxes  int // live and being made
	closed bool
	lns    map[net.Listener]struct{}
	conns  map[net.Conn]struct{}
	bound  map[string]*held // session key → the box bound to it
	wg     sync.WaitGroup

	pending chan struct{} // a place for each connection not yet authenticated
	// Refused connections are logged at most once a second, with the
	// count since the last line: anyone who reaches the port can make them.
	refusals atomic.Int64
	refusing rate.Sometimes
}

// forwarder is a box that relays another host's requests: every box on
// sandbox.AgentConn.
type forwarder interface {
	sandbox.Sandbox
	Hello() agentproto.Hello
	Forward(ctx context.Context, req agentproto.Request, live sandbox.OutputFunc) (*agentproto.Response, error)
}

// maxInFlight bounds the requests of one box the node relays at once; the
// node reads no further frames of the connection until one is answered.
const maxInFlight = 32

// NewNode returns a node; Serve serves it.
func NewNode(o NodeOptions) (*Node, error) {
	if o.Backend == nil || o.TLS == nil {
		return nil, errors.New("cluster: a node needs a backend and a TLS configuration")
	}
	if o.MaxBoxes <= 0 {
		return nil, errors.New("cluster: a node needs a cap on its boxes")
	}
	if o.TLS.ClientAuth != tls.RequireAndVerifyClientCert {
		return nil, errors.New("cluster: a node serves only fronts with a certificate (tls.RequireAndVerifyClientCert)")
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = 10 * time.Second
	}
	if o.CreateTimeout <= 0 {
		o.CreateTimeout = 2 * time.Minute
	}
	if o.MaxPending <= 0 {
		o.MaxPending = DefaultMaxPending
	}
	if o.OrphanGrace == 0 {
		o.OrphanGrace = DefaultOrphanGrace
	}
	o.Limits = o.Limits.WithDefaults()
	return &Node{o: o, log: o.Logger, name: randomName("run-"), lns: map[net.Listener]struct{}{}, conns: map[net.Conn]struct{}{}, bound: map[string]*held{},
		pending: make(chan struct{}, o.MaxPending), refusing: rate.Sometimes{Interval: time.Second}}, nil
}

// refused counts a connection refused before its front was known, and
// logs it unless another was logged in the last second.
func (n *Node) refused(from net.Addr, why string, err error) {
	n.refusals.Add(1)
	n.refusing.Do(func() {
		n.log.Warn("refused connections", "count", n.refusals.Swap(0), "last_from", from.String(), "last", why, "err", err)
	})
}

// Status is what the node would answer a front's OpStatus now.
func (n *Node) Status() Status {
	n.mu.Lock()
	defer n.mu.Unlock()
	return Status{Node: n.name, Backend: n.o.Backend.Name(), Boxes: n.boxes, MaxBoxes: n.o.MaxBoxes}
}

// Serve accepts fronts on ln (plain TCP: the node does the TLS) until ln
// fails or Close is called; it returns nil after Close.
func (n *Node) Serve(ln net.Listener) error {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		ln.Close()
		return nil
	}
	n.lns[ln] = struct{}{}
	n.mu.Unlock()
	for {
		c, err := ln.Accept()
		if err != nil {
			n.mu.Lock()
			closed := n.closed
			delete(n.lns, ln)
			n.mu.Unlock()
			if closed {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return err
		}
		select {
		case n.pending <- struct{}{}:
		default:
			c.Close()
			n.refused(c.RemoteAddr(), "too many connections not yet authenticated", fmt.Errorf("%d pending", n.o.MaxPending))
			continue
		}
		if !n.track(c) {
			c.Close()
			return nil
		}
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			defer n.untrack(c)
			n.serveConn(c)
		}()
	}
}

func (n *Node) track(c net.Conn) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return false
	}
	n.conns[c] = struct{}{}
	return true
}

func (n *Node) untrack(c net.Conn) {
	c.Close()
	n.mu.Lock()
	delete(n.conns, c)
	n.mu.Unlock()
}

// Close stops serving, closes every connection, destroys every box (the
// orphaned ones too) and waits for them. It does not close the backend.
func (n *Node) Close() error {
	n.mu.Lock()
	n.closed = true
	for ln := range n.lns {
		ln.Close()
	}
	for c := range n.conns {
		c.Close()
	}
	var orphans []*held
	for _, h := range n.bound {
		if h.orphan != nil && h.orphan.Stop() {
			h.orphan = nil
			n.forgetLocked(h)
			orphans = append(orphans, h)
		}
	}
	n.mu.Unlock()
	for _, h := range orphans {
		n.destroy(h)
	}
	n.wg.Wait()
	return nil
}

// serveConn handles one front's connection: a status, or a box for as
// long as the connection lasts.
func (n *Node) serveConn(raw net.Conn) {
	log := n.log.With("front", raw.RemoteAddr().String())
	authenticated := false
	defer func() {
		if !authenticated {
			<-n.pending
		}
	}()
	tc := tls.Server(raw, n.o.TLS)
	raw.SetDeadline(time.Now().Add(n.o.HandshakeTimeout))
	if err := tc.Handshake(); err != nil {
		n.refused(raw.RemoteAddr(), "TLS handshake", err)
		return
	}
	var open Open
	err := agentproto.ReadFrameMax(tc, &open, func() int { return maxOpenFrame })
	if err == nil {
		err = open.check()
	}
	if err != nil {
		n.refused(raw.RemoteAddr(), "a front's first frame", err)
		return
	}
	raw.SetDeadline(time.Time{})
	authenticated = true
	<-n.pending
	switch open.Op {
	case OpStatus:
		st := n.Status()
		st.Holds = open.Key != "" && n.holds(open.Key)
		agentproto.WriteFrame(tc, &st)
	case OpAdopt:
		h, att := n.adopt(open.Key)
		st := n.Status()
		st.Holds = h != nil
		if err := agentproto.WriteFrame(tc, &st); err != nil || h == nil {
			if h != nil {
				n.letGo(h, att, endFront, log)
			}
			return
		}
		log = log.With("box", h.box.ID())
		log.Info("a front adopted a session's box")
		n.letGo(h, att, n.relay(tc, h, att, log), log)
	case OpCreate:
		st := n.Status()
		if err := agentproto.WriteFrame(tc, &st); err != nil {
			return
		}
		box, err := n.create(open)
		if err != nil {
			log.Warn("making a box for a front", "err", err)
			agentproto.WriteFrame(tc, &agentproto.Hello{Version: agentproto.Version, Error: err.Error()})
			return
		}
		h, att := &held{box: box}, newAttachment()
		h.att = att
		log = log.With("box", box.ID())
		log.Debug("made a box for a front", "limits", open.Limits)
		n.letGo(h, att, n.relay(tc, h, att, log), log)
	}
}

// held is a box the node made for a front. One relay at a time serves it
// (att). Bound to a session (key), it outlives its front's connection by
// OrphanGrace, for another front to adopt. Its fields are guarded by the
// node's mu.
type held struct {
	box    forwarder
	key    string      // the session key it is bound to, "" for none
	att    *attachment // the relay serving it; nil while orphaned
	orphan *time.Timer // set while orphaned
	gone   bool        // destroyed, or being destroyed
}

// attachment is one relay's hold on a box: stop is closed to take the box
// from it (another front adopts it), done once it has let go.
type attachment struct {
	stop, done chan struct{}
	once       sync.Once
}

func newAttachment() *attachment {
	return &attachment{stop: make(chan struct{}), done: make(chan struct{})}
}

func (a *attachment) detach() { a.once.Do(func() { close(a.stop) }) }

// end is why a relay ended.
type end int

const (
	endFront    end = iota // the front's connection ended
	endBox                 // the box died or broke
	endDetached            // another front adopted the box
)

// holds says whether a box is bound to key.
func (n *Node) holds(key string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	h := n.bound[key]
	return h != nil && !h.gone
}

// adopt takes the box bound to key for a new relay: from its orphan
// timer, or from the relay serving it, which it waits to let go. Of
// adopters racing, the last one to claim it wins; nil if no box holds key.
func (n *Node) adopt(key string) (*held, *attachment) {
	n.mu.Lock()
	h := n.bound[key]
	if h == nil || h.gone || n.closed {
		n.mu.Unlock()
		return nil, nil
	}
	if h.orphan != nil {
		if !h.orphan.Stop() {
			n.mu.Unlock() // its grace ran out: it is being destroyed
			return nil, nil
		}
		h.orphan = nil
	}
	old, att := h.att, newAttachment()
	h.att = att
	n.mu.Unlock()
	if old != nil {
		old.detach()
		<-old.done
	}
	return h, att
}

// letGo ends att's hold on h for why: nothing more if another front
// adopted it; a box bound to a session whose front went is kept for the
// orphan grace; any other is destroyed.
func (n *Node) letGo(h *held, att *attachment, why end, log *slog.Logger) {
	defer close(att.done)
	n.mu.Lock()
	if h.att != att {
		n.mu.Unlock()
		log.Debug("another front took the box over")
		return
	}
	h.att = nil
	if why == endFront && h.key != "" && !n.closed && n.o.OrphanGrace > 0 {
		h.orphan = time.AfterFunc(n.o.OrphanGrace, func() { n.expire(h, log) })
		n.mu.Unlock()
		log.Info("kept a session's box whose front went, for another front to adopt", "for", n.o.OrphanGrace)
		return
	}
	n.forgetLocked(h)
	n.mu.Unlock()
	n.destroy(h)
	log.Debug("destroyed a front's box")
}

// expire destroys an orphaned box whose grace ran out.
func (n *Node) expire(h *held, log *slog.Logger) {
	n.mu.Lock()
	if h.att != nil || h.gone {
		n.mu.Unlock()
		return
	}
	h.orphan = nil
	n.forgetLocked(h)
	n.mu.Unlock()
	n.destroy(h)
	log.Info("destroyed a session's box no front adopted", "after", n.o.OrphanGrace)
}

// forgetLocked marks h gone and unbinds it.
func (n *Node) forgetLocked(h *held) {
	h.gone = true
	if h.key != "" && n.bound[h.key] == h {
		delete(n.bound, h.key)
	}
	h.key = ""
}

func (n *Node) destroy(h *held) {
	h.box.Close()
	n.release()
}

// bind answers OpBind and OpUnbind for the box att serves. A box bound
// to a key another box held takes the key over; that box, if orphaned,
// is destroyed (its session went on in this one).
func (n *Node) bind(h *held, att *attachment, req agentproto.Request) *agentproto.Response {
	if req.Op == agentproto.OpBind && !validKey(req.Key) {
		return &agentproto.Response{Error: fmt.Sprintf("a malformed session key (%d bytes)", len(req.Key))}
	}
	n.mu.Lock()
	if h.att != att || h.gone {
		n.mu.Unlock()
		return &agentproto.Response{Error: "another front took the box over"}
	}
	if h.key != "" && n.bound[h.key] == h {
		delete(n.bound, h.key)
	}
	h.key = ""
	var displaced *held
	if req.Op == agentproto.OpBind {
		if old := n.bound[req.Key]; old != nil {
			old.key = ""
			if old.orphan != nil && old.orphan.Stop() {
				old.orphan = nil
				n.forgetLocked(old)
				displaced = old
			}
		}
		n.bound[req.Key] = h
		h.key = req.Key
	}
	n.mu.Unlock()
	if displaced != nil {
		n.destroy(displaced)
	}
	return &agentproto.Response{}
}

// create makes a box within the node's limits and cap. The box counts
// against the cap until release.
func (n *Node) create(open Open) (forwarder, error) {
	n.mu.Lock()
	if n.boxes >= n.o.MaxBoxes {
		n.mu.Unlock()
		return nil, fmt.Errorf("node full: %d of %d boxes in use", n.o.MaxBoxes, n.o.MaxBoxes)
	}
	n.boxes++
	n.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), n.o.CreateTimeout)
	defer cancel()
	box, err := n.o.Backend.Create(ctx, sandbox.Spec{
		ID:      randomName("node-"),
		Limits:  open.Limits.Within(n.o.Limits),
		Preload: n.o.Preload,
		Urgent:  open.Urgent,
	})
	if err != nil {
		n.release()
		return nil, err
	}
	fw, ok := box.(forwarder)
	if !ok {
		box.Close()
		n.release()
		return nil, fmt.Errorf("the %s backend's boxes cannot be served to a front (they do not host kiln-agent)", n.o.Backend.Name())
	}
	return fw, nil
}

func (n *Node) release() {
	n.mu.Lock()
	n.boxes--
	n.mu.Unlock()
}

// randomName is prefix and 64 random bits: a node's run, and the name of
// each of its boxes (the node's own, whatever the front calls it).
func randomName(prefix string) string {
	var b [8]byte
	rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// relay serves h's box to the front on tc until either end goes or
// another front adopts the box: the front's requests to the box as the
// node's own, its answers back under the front's IDs. The caller lets the
// box go (letGo) for the reason relay returns.
func (n *Node) relay(tc *tls.Conn, h *held, att *attachment, log *slog.Logger) (why end) {
	box := h.box
	ctx, cancel := context.WithCancel(context.Background())
	sem := make(chan struct{}, maxInFlight)
	var wg sync.WaitGroup
	var broke atomic.Bool
	defer func() {
		// Whichever end went, the relay does: the requests still relayed
		// end (the box's answers to them are dropped) before it returns.
		cancel()
		tc.Close()
		wg.Wait()
		select {
		case <-att.stop:
			why = endDetached
		case <-box.Done():
			why = endBox
		default:
			if broke.Load() {
				why = endBox
			}
		}
	}()
	go func() {
		select {
		case <-box.Done():
			log.Debug("the box died")
		case <-att.stop:
			log.Debug("another front is adopting the box")
		case <-ctx.Done():
		}
		cancel()
		tc.Close() // unblocks the writes and the reader below
	}()
	hello := box.Hello()
	if err := agentproto.WriteFrame(tc, &hello); err != nil {
		return endFront
	}
	// One writer puts the frames on the connection in the order they
	// come: a request's live output before its answer. Answers wait for
	// room; a live report finding none is dropped (a newer one follows).
	frames := make(chan *agentproto.Response, 2*maxInFlight)
	go func() {
		defer cancel()
		for {
			select {
			case f := <-frames:
				if err := agentproto.WriteFrame(tc, f); err != nil {
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	for {
		var req agentproto.Request
		if err := agentproto.ReadFrame(tc, &req); err != nil {
			if ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				log.Debug("the front's connection ended", "err", err)
			}
			return endFront
		}
		if req.Op == agentproto.OpBind || req.Op == agentproto.OpUnbind {
			resp := n.bind(h, att, req)
			resp.ID = req.ID
			select {
			case frames <- resp:
			case <-ctx.Done():
				return endFront
			}
			continue
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return endFront
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			id := req.ID
			live := func(o agentproto.Output) {
				select {
				case frames <- &agentproto.Response{ID: id, Output: &o}:
				default:
				}
			}
			var resp *agentproto.Response
			var err error
			if req.Op == agentproto.OpLimits {
				resp = limitsOf(box)
			} else {
				resp, err = box.Forward(ctx, req, live)
			}
			if err != nil {
				if ctx.Err() == nil {
					log.Warn("relaying a request", "op", req.Op, "err", err)
					broke.Store(true) // the box is gone or broke: so is the connection
				}
				cancel()
				return
			}
			resp.ID = id
			select {
			case frames <- resp:
			case <-ctx.Done():
			}
		}()
	}
}

// limitsOf answers OpLimits for box from the node's own count.
func limitsOf(box sandbox.Sandbox) *agentproto.Response {
	l := agentproto.Limits{OOMKills: -1, PidsRefused: -1}
	if r, ok := box.(sandbox.LimitReporter); ok {
		h := r.LimitHits()
		l = agentproto.Limits{OOMKills: h.OOMKills, PidsRefused: h.PidsRefused}
	}
	return &agentproto.Response{Limits: &l}
}
