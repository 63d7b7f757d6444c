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
}

// DefaultMaxPending is NodeOptions.MaxPending's default.
const DefaultMaxPending = 64

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
	o.Limits = o.Limits.WithDefaults()
	return &Node{o: o, log: o.Logger, name: randomName("run-"), lns: map[net.Listener]struct{}{}, conns: map[net.Conn]struct{}{},
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

// Close stops serving, closes every connection (destroying its box) and
// waits for them. It does not close the backend.
func (n *Node) Close() error {
	n.mu.Lock()
	n.closed = true
	for ln := range n.lns {
		ln.Close()
	}
	for c := range n.conns {
		c.Close()
	}
	n.mu.Unlock()
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
	st := n.Status()
	if err := agentproto.WriteFrame(tc, &st); err != nil || open.Op == OpStatus {
		return
	}
	box, err := n.create(open)
	if err != nil {
		log.Warn("making a box for a front", "err", err)
		agentproto.WriteFrame(tc, &agentproto.Hello{Version: agentproto.Version, Error: err.Error()})
		return
	}
	defer n.release()
	log = log.With("box", box.ID())
	log.Debug("made a box for a front", "limits", open.Limits)
	n.relay(tc, box, log)
	log.Debug("destroyed a front's box")
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

// relay serves box to the front on tc until either end goes: the front's
// requests to the box as the node's own, its answers back under the
// front's IDs. The box is closed when relay returns.
func (n *Node) relay(tc *tls.Conn, box forwarder, log *slog.Logger) {
	ctx, cancel := context.WithCancel(context.Background())
	sem := make(chan struct{}, maxInFlight)
	var wg sync.WaitGroup
	defer func() {
		// Whichever end went, the box goes: closing it ends the
		// requests still relayed.
		cancel()
		box.Close()
		wg.Wait()
	}()
	hello := box.Hello()
	if err := agentproto.WriteFrame(tc, &hello); err != nil {
		return
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
	go func() {
		select {
		case <-box.Done():
			log.Debug("the box died")
		case <-ctx.Done():
		}
		cancel()
		tc.Close() // unblocks the reader below
	}()
	for {
		var req agentproto.Request
		if err := agentproto.ReadFrame(tc, &req); err != nil {
			if ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				log.Debug("the front's connection ended", "err", err)
			}
			return
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
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
				}
				cancel() // the box is gone or broke: so is the connection
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
