package cluster

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// Options configure the cluster backend of a front.
type Options struct {
	// Nodes are the addresses (host:port) of the kiln nodes to place
	// boxes on.
	Nodes []string
	// Discover, instead of Nodes, lists the nodes' addresses: the nodes
	// registered in the cluster's API (kubernetes.NodeLister). A listing
	// stands for DiscoverEvery (default 5 s); when a listing fails, the
	// last one stands, so that the nodes keep serving while the API
	// server is away.
	Discover      func(context.Context) ([]string, error)
	DiscoverEvery time.Duration
	// TLS is the front's client configuration (FrontTLS).
	TLS    *tls.Config
	Logger *slog.Logger
	// DialTimeout bounds reaching a node, its handshake and its status
	// (default 5 s).
	DialTimeout time.Duration
}

// Backend places boxes on kiln nodes: the cluster backend.
type Backend struct {
	o   Options
	log *slog.Logger

	mu     sync.Mutex
	listed []string  // the last listing of Discover
	until  time.Time // when it stops standing

	boxMu sync.Mutex
	boxes map[string]*box // live boxes by ID, for Bind
}

var (
	_ sandbox.Backend  = (*Backend)(nil)
	_ sandbox.Checker  = (*Backend)(nil)
	_ sandbox.Noter    = (*Backend)(nil)
	_ sandbox.Adopter  = (*Backend)(nil)
	_ sandbox.Releaser = (*Backend)(nil)
)

// New returns the cluster backend over o.Nodes.
func New(o Options) (*Backend, error) {
	if len(o.Nodes) == 0 && o.Discover == nil {
		return nil, errors.New("the cluster backend needs the addresses of its nodes (--cluster-nodes), or where to find them (--cluster-discover)")
	}
	if len(o.Nodes) > 0 && o.Discover != nil {
		return nil, errors.New("the cluster backend takes its nodes from --cluster-nodes or from --cluster-discover, not both")
	}
	if o.DiscoverEvery <= 0 {
		o.DiscoverEvery = 5 * time.Second
	}
	if o.TLS == nil {
		return nil, errors.New("the cluster backend needs its certificates (--cluster-tls)")
	}
	for _, a := range o.Nodes {
		if _, _, err := net.SplitHostPort(a); err != nil {
			return nil, fmt.Errorf("node address %q: %w", a, err)
		}
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.DialTimeout <= 0 {
		o.DialTimeout = 5 * time.Second
	}
	return &Backend{o: o, log: o.Logger, boxes: map[string]*box{}}, nil
}

func (b *Backend) Name() string { return "cluster" }

func (b *Backend) Close() error { return nil }

func (b *Backend) Notes() []string {
	if b.o.Discover != nil {
		return []string{"boxes are placed on the kiln nodes registered in the cluster, the one with the largest share of free boxes first"}
	}
	return []string{fmt.Sprintf("boxes are placed on %d kiln node(s), the one with the largest share of free boxes first", len(b.o.Nodes))}
}

// nodes are the nodes' addresses: Nodes, or Discover's listing.
func (b *Backend) nodes(ctx context.Context) ([]string, error) {
	if b.o.Discover == nil {
		return b.o.Nodes, nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if time.Now().Before(b.until) {
		return b.listed, nil
	}
	got, err := b.o.Discover(ctx)
	if err != nil {
		if b.listed == nil {
			return nil, err
		}
		b.log.Warn("listing the kiln nodes; placing on the last listing", "err", err, "nodes", len(b.listed))
	} else {
		b.listed = got
	}
	b.until = time.Now().Add(b.o.DiscoverEvery)
	return b.listed, nil
}

// Check makes a box on some node and runs a command in it.
func (b *Backend) Check(ctx context.Context) error {
	box, err := b.Create(ctx, sandbox.Spec{ID: "check"})
	if err != nil {
		return err
	}
	defer box.Close()
	return sandbox.Probe(ctx, box)
}

// Create places the box on the node with the largest share of free boxes
// (ties: the first in Nodes), and on the next when that one refuses it.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	order, errs := b.place(ctx)
	for _, addr := range order {
		box, err := b.createOn(ctx, addr, spec)
		if err == nil {
			return box, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		errs = append(errs, fmt.Errorf("node %s: %w", addr, err))
	}
	if len(order) == 0 && len(errs) == 0 {
		errs = append(errs, errors.New("every node is full"))
	}
	return nil, fmt.Errorf("no kiln node made a box: %w", errors.Join(errs...))
}

// place asks every node for its status at once and orders the nodes with
// room by their share of free boxes; what nodes could not answer is errs.
func (b *Backend) place(ctx context.Context) (order []string, errs []error) {
	nodes, err := b.nodes(ctx)
	if err != nil {
		return nil, []error{err}
	}
	type answer struct {
		i   int
		st  Status
		err error
	}
	ch := make(chan answer, len(nodes))
	for i, addr := range nodes {
		go func() {
			st, err := b.Status(ctx, addr)
			ch <- answer{i, st, err}
		}()
	}
	var ok []answer
	for range nodes {
		a := <-ch
		switch {
		case a.err != nil:
			errs = append(errs, fmt.Errorf("node %s: %w", nodes[a.i], a.err))
		case a.st.Free() > 0:
			ok = append(ok, a)
		default:
			errs = append(errs, fmt.Errorf("node %s: full (%d of %d boxes)", nodes[a.i], a.st.Boxes, a.st.MaxBoxes))
		}
	}
	slices.SortFunc(ok, func(x, y answer) int {
		return cmp.Or(cmp.Compare(y.st.Free(), x.st.Free()), cmp.Compare(x.i, y.i))
	})
	for _, a := range ok {
		order = append(order, nodes[a.i])
	}
	return order, errs
}

// Status asks the node at addr what it holds.
func (b *Backend) Status(ctx context.Context, addr string) (Status, error) {
	return b.status(ctx, addr, "")
}

// status asks the node at addr what it holds, and with key (a
// SessionKey) whether it holds that session's box.
func (b *Backend) status(ctx context.Context, addr, key string) (Status, error) {
	c, st, err := b.dial(ctx, addr, Open{Op: OpStatus, Key: key})
	if err != nil {
		return Status{}, err
	}
	c.Close()
	return st, nil
}

// dial connects to the node at addr over TLS, writes open and reads the
// node's status, all within ctx and DialTimeout: a node that takes the
// connection and never answers does not hold a Create up.
func (b *Backend) dial(ctx context.Context, addr string, open Open) (*tls.Conn, Status, error) {
	ctx, cancel := context.WithTimeout(ctx, b.o.DialTimeout)
	defer cancel()
	d := tls.Dialer{NetDialer: &net.Dialer{Timeout: b.o.DialTimeout, KeepAlive: 15 * time.Second}, Config: b.o.TLS}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, Status{}, err
	}
	c := nc.(*tls.Conn)
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	var st Status
	err = agentproto.WriteFrame(c, &open)
	if err == nil {
		err = agentproto.ReadFrameMax(c, &st, func() int { return maxOpenFrame })
	}
	if err == nil {
		err = st.check()
	}
	if !stop() && err == nil {
		err = ctx.Err()
	}
	if err != nil {
		c.Close()
		return nil, Status{}, fmt.Errorf("reading its status: %w", err)
	}
	return c, st, nil
}

// createOn asks the node at addr for a box and waits for its agent.
func (b *Backend) createOn(ctx context.Context, addr string, spec sandbox.Spec) (sandbox.Sandbox, error) {
	c, st, err := b.dial(ctx, addr, Open{Op: OpCreate, Limits: spec.Limits, Urgent: spec.Urgent})
	if err != nil {
		return nil, err
	}
	conn, err := sandbox.DialAgent(ctx, spec.ID, c, nil, &sandbox.AgentConnOptions{Logger: b.log.With("node", addr), Backend: b.Name()})
	if err != nil {
		return nil, err
	}
	b.log.Debug("placed a box", "box", spec.ID, "node", addr)
	return b.track(&box{AgentConn: conn, node: addr, run: st.Node, front: b}), nil
}

func (b *Backend) track(bx *box) *box {
	b.boxMu.Lock()
	b.boxes[bx.ID()] = bx
	b.boxMu.Unlock()
	return bx
}

func (b *Backend) untrack(bx *box) {
	b.boxMu.Lock()
	if b.boxes[bx.ID()] == bx {
		delete(b.boxes, bx.ID())
	}
	b.boxMu.Unlock()
}

// Bind binds sb, a live box of this front, to the session key on its
// node: if this front goes without closing it, the node keeps it for its
// orphan grace, and any front may adopt it.
func (b *Backend) Bind(ctx context.Context, sb sandbox.Sandbox, key string) error {
	b.boxMu.Lock()
	bx := b.boxes[sb.ID()]
	b.boxMu.Unlock()
	if bx == nil {
		return fmt.Errorf("binding box %s: not a live box of this front", sb.ID())
	}
	resp, err := bx.Forward(ctx, agentproto.Request{Op: agentproto.OpBind, Key: SessionKey(key)}, nil)
	if err == nil && resp.Error != "" {
		err = errors.New(resp.Error)
	}
	if err != nil {
		return fmt.Errorf("binding box %s on node %s: %w", sb.ID(), bx.node, err)
	}
	bx.bound.Store(true)
	return nil
}

// Release leaves sb, a live box of this front bound to a session, on its
// node when it is closed: the node keeps it for its orphan grace, for
// another front to adopt.
func (b *Backend) Release(sb sandbox.Sandbox) error {
	b.boxMu.Lock()
	bx := b.boxes[sb.ID()]
	b.boxMu.Unlock()
	if bx == nil || !bx.bound.Load() {
		return fmt.Errorf("releasing box %s: not a live box of this front bound to a session", sb.ID())
	}
	bx.released.Store(true)
	return nil
}

// Adopt takes over the box bound to the session key on whichever node
// holds it, from the front that holds it (alive, or gone within the
// node's orphan grace). It asks every node at once; a node that cannot
// be reached holds nothing this front can have.
func (b *Backend) Adopt(ctx context.Context, key string) (sandbox.Sandbox, error) {
	nodes, err := b.nodes(ctx)
	if err != nil {
		return nil, err
	}
	k := SessionKey(key)
	type answer struct {
		i     int
		holds bool
	}
	ch := make(chan answer, len(nodes))
	for i, addr := range nodes {
		go func() {
			st, err := b.status(ctx, addr, k)
			ch <- answer{i, err == nil && st.Holds}
		}()
	}
	var holders []int
	for range nodes {
		if a := <-ch; a.holds {
			holders = append(holders, a.i)
		}
	}
	slices.Sort(holders)
	var errs []error
	for _, i := range holders {
		addr := nodes[i]
		c, st, err := b.dial(ctx, addr, Open{Op: OpAdopt, Key: k})
		if err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", addr, err))
			continue
		}
		if !st.Holds {
			c.Close() // adopted by another front, or expired, since it answered
			continue
		}
		id := randomName("adopted-")
		conn, err := sandbox.DialAgent(ctx, id, c, nil, &sandbox.AgentConnOptions{Logger: b.log.With("node", addr), Backend: b.Name()})
		if err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", addr, err))
			continue
		}
		b.log.Debug("adopted a session's box", "box", id, "node", addr)
		bx := &box{AgentConn: conn, node: addr, run: st.Node, front: b}
		bx.bound.Store(true)
		return b.track(bx), nil
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("adopting the session's box: %w", errors.Join(errs...))
	}
	return nil, sandbox.ErrNoBox
}

// box is a box on a node, spoken to through the node.
type box struct {
	*sandbox.AgentConn
	node  string // the node's address
	run   string // the run of the node that made it (Status.Node)
	front *Backend

	bound    atomic.Bool // bound to a session on its node (Bind, Adopt)
	released atomic.Bool // left bound at Close, for another front (Release)

	lostOnce sync.Once
	lost     string
}

// Close destroys the box: a bound one is unbound first, so that its node
// destroys it rather than keep it for another front. A released one
// stays bound: the node keeps it for another front.
func (b *box) Close() error {
	if b.bound.Swap(false) && !b.released.Load() {
		ctx, cancel := context.WithTimeout(context.Background(), b.front.o.DialTimeout)
		b.Forward(ctx, agentproto.Request{Op: agentproto.OpUnbind}, nil)
		cancel()
	}
	b.front.untrack(b)
	return b.AgentConn.Close()
}

var (
	_ sandbox.HostLossReporter = (*box)(nil)
	_ sandbox.LimitReporter    = (*box)(nil)
)

// LimitHits asks the node what the box's limits stopped, -1 each when
// it cannot tell (the box is gone).
func (b *box) LimitHits() sandbox.LimitHits {
	ctx, cancel := context.WithTimeout(context.Background(), b.front.o.DialTimeout)
	defer cancel()
	h, err := b.Limits(ctx)
	if err != nil {
		return sandbox.LimitHits{OOMKills: -1, PidsRefused: -1}
	}
	return h
}

// HostLost asks, once the box is done, whether its node is still there,
// the same run of it: if the node cannot be reached or restarted, the box
// went with it. The answer is kept.
func (b *box) HostLost() string {
	select {
	case <-b.Done():
	default:
		return ""
	}
	b.lostOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), b.front.o.DialTimeout)
		defer cancel()
		st, err := b.front.Status(ctx, b.node)
		switch {
		case err != nil:
			b.lost = fmt.Sprintf("the kiln node at %s that ran the sandbox was lost (%v)", b.node, err)
		case st.Node != b.run:
			b.lost = fmt.Sprintf("the kiln node at %s that ran the sandbox restarted", b.node)
		}
		if b.lost != "" {
			b.front.log.Warn("a box's node was lost", "box", b.ID(), "node", b.node, "why", b.lost)
		}
	})
	return b.lost
}

// NodeOf is the address of the node a box of the cluster backend is on,
// "" for another backend's.
func NodeOf(s sandbox.Sandbox) string {
	if b, ok := s.(*box); ok {
		return b.node
	}
	return ""
}
