package session

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"sync"
	"time"

	"kiln/internal/event"
	"kiln/internal/sandbox"
)

// Pool keeps boxes that have never run model code ready ahead of demand,
// refilled in the background and never reused. Get never waits longer
// than creating a box directly: when the pool is empty it starts one for
// the call and takes whichever is ready first, that one or the refill's.
type Pool struct {
	backend sandbox.Backend
	spec    sandbox.Spec
	size    int
	log     *slog.Logger
	obs     event.Observer
	slots   *slots // the cap on live boxes the pool's boxes count against

	ready    chan sandbox.Sandbox
	kick     chan struct{}
	mu       sync.Mutex
	inflight int
	closed   bool
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

// PoolOptions configure a pool.
type PoolOptions struct {
	Size        int // boxes kept ready; 0 disables the pool
	Concurrency int // boxes created at once while refilling; default 1
	Logger      *slog.Logger
	Observer    event.Observer // told of every box creation and pool miss
}

// NewPool starts filling a pool of boxes made from spec (its ID is
// replaced per box).
func NewPool(b sandbox.Backend, spec sandbox.Spec, opts PoolOptions) *Pool {
	return newPool(b, spec, opts, newSlots(0))
}

// newPool makes a pool whose boxes, and the boxes it makes for calls, each
// hold one of slots until they are destroyed.
func newPool(b sandbox.Backend, spec sandbox.Spec, opts PoolOptions, sl *slots) *Pool {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Concurrency <= 0 {
		opts.Concurrency = 1
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Pool{
		backend: b, spec: spec, size: opts.Size, log: opts.Logger, obs: opts.Observer, slots: sl,
		ready: make(chan sandbox.Sandbox, max(opts.Size, 1)),
		kick:  make(chan struct{}, 1),
		ctx:   ctx, cancel: cancel,
	}
	if opts.Size > 0 {
		for range opts.Concurrency {
			p.wg.Add(1)
			go p.fill()
		}
	}
	return p
}

func newID() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// create makes a box with a slot its caller holds: the box keeps the slot
// until it is destroyed, or the slot goes back now if creation fails.
// urgent: a call is waiting for it (sandbox.Spec.Urgent).
func (p *Pool) create(ctx context.Context, urgent bool) (sandbox.Sandbox, error) {
	spec := p.spec
	spec.ID = newID()
	spec.Urgent = urgent
	start := time.Now()
	box, err := p.backend.Create(ctx, spec)
	event.Emit(p.obs, event.Box{Time: time.Now(), Backend: p.backend.Name(), Duration: time.Since(start), Err: err != nil})
	if err != nil {
		p.slots.release()
		return nil, err
	}
	return &countedBox{Sandbox: box, release: p.slots.release}, nil
}

func (p *Pool) fill() {
	defer p.wg.Done()
	backoff := 100 * time.Millisecond
	for p.ctx.Err() == nil {
		if !p.reserve() {
			p.idle()
			continue
		}
		// The pool yields: it takes a slot only when one is free and no
		// call is waiting for it.
		if !p.slots.tryIdle() {
			p.release()
			p.idle()
			continue
		}
		box, err := p.create(p.ctx, false)
		if err != nil {
			p.release()
			if p.ctx.Err() != nil {
				return
			}
			p.log.Warn("preparing a pooled sandbox", "err", err)
			select {
			case <-time.After(backoff):
			case <-p.ctx.Done():
				return
			}
			backoff = min(backoff*2, 30*time.Second)
			continue
		}
		backoff = 100 * time.Millisecond
		p.ready <- box // never blocks: reserve counted it
		p.release()
	}
}

// idle waits until the pool may have room, or a box slot came free.
func (p *Pool) idle() {
	select {
	case <-p.kick:
	case <-p.slots.freed:
	case <-time.After(time.Second):
	case <-p.ctx.Done():
	}
}

// reserve claims a slot for one more box if ready + in-flight < size.
func (p *Pool) reserve() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.ready)+p.inflight >= p.size {
		return false
	}
	p.inflight++
	return true
}

func (p *Pool) release() {
	p.mu.Lock()
	p.inflight--
	p.mu.Unlock()
}

// errNoSlot means no box came free within the wait.
var errNoSlot = errors.New("no sandbox slot came free")

// Get returns a fresh box: a pooled one if one is ready and alive, else
// whichever comes first of a box made now for this call and the next box
// the refill finishes. A call never waits longer than creating its box
// directly would take; the box that loses the race joins the pool (or is
// destroyed if the pool is full).
func (p *Pool) Get(ctx context.Context) (sandbox.Sandbox, error) { return p.get(ctx, 0) }

// get is Get under the cap on live boxes: when every slot is taken it
// waits, at most wait (0: as long as ctx lasts), for a slot or a pooled box,
// whichever comes first, then fails with errNoSlot.
func (p *Pool) get(ctx context.Context, wait time.Duration) (sandbox.Sandbox, error) {
	if box := p.take(); box != nil {
		return box, nil
	}
	if p.size > 0 {
		event.Emit(p.obs, event.Box{Time: time.Now(), Backend: p.backend.Name(), PoolMiss: true})
	}
	w := p.slots.wait()
	var expired <-chan time.Time
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		expired = t.C
	}
	var ready chan sandbox.Sandbox
	if p.size > 0 {
		ready = p.ready
	}
waiting:
	for {
		select {
		case <-w.ready:
			break waiting
		case box := <-ready:
			p.kickRefill()
			if !alive(box) {
				box.Close()
				continue
			}
			p.slots.cancel(w)
			return box, nil
		case <-expired:
			p.slots.cancel(w)
			return nil, errNoSlot
		case <-ctx.Done():
			p.slots.cancel(w)
			return nil, ctx.Err()
		}
	}
	// This call holds a slot now; the box made with it keeps it.
	if p.size == 0 {
		return p.create(ctx, true)
	}
	type made struct {
		box sandbox.Sandbox
		err error
	}
	direct := make(chan made, 1)
	if !p.track(func() {
		box, err := p.create(p.ctx, true)
		direct <- made{box, err}
	}) {
		return p.create(ctx, true) // the pool is closing
	}
	adopt := func() {
		// The direct creation lost (or its caller left): pool its box.
		p.track(func() {
			if m := <-direct; m.box != nil {
				p.offer(m.box)
			}
		})
	}
	for {
		select {
		case m := <-direct:
			if m.err != nil && ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return m.box, m.err
		case box := <-p.ready:
			p.kickRefill()
			if !alive(box) {
				box.Close()
				continue
			}
			adopt()
			return box, nil
		case <-ctx.Done():
			adopt()
			return nil, ctx.Err()
		}
	}
}

func alive(box sandbox.Sandbox) bool {
	select {
	case <-box.Done():
		return false
	default:
		return true
	}
}

// take returns a ready, live box without waiting, or nil.
func (p *Pool) take() sandbox.Sandbox {
	for {
		select {
		case box := <-p.ready:
			p.kickRefill()
			select {
			case <-box.Done():
				box.Close() // died while waiting; take the next
				continue
			default:
				return box
			}
		default:
			return nil
		}
	}
}

// track runs f in a goroutine Close waits for, unless the pool is closed.
func (p *Pool) track(f func()) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		f()
	}()
	return true
}

func (p *Pool) kickRefill() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// offer puts a never-used box into the pool if there is room, else
// destroys it.
func (p *Pool) offer(box sandbox.Sandbox) {
	p.mu.Lock()
	room := p.ctx.Err() == nil && len(p.ready)+p.inflight < p.size
	if room {
		p.ready <- box // never blocks: room counted it
	}
	p.mu.Unlock()
	if !room {
		box.Close()
	}
}

// Close stops refilling and destroys the ready boxes.
func (p *Pool) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	p.wg.Wait()
	for {
		select {
		case box := <-p.ready:
			box.Close()
		default:
			return
		}
	}
}
