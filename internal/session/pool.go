package session

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"sync"
	"time"

	"kiln/internal/sandbox"
)

// Pool keeps boxes that have never run model code ready ahead of demand,
// refilled in the background and never reused. Get never waits for the
// refill: when the pool is empty it creates a box directly, which is what
// a call would cost without a pool.
type Pool struct {
	backend sandbox.Backend
	spec    sandbox.Spec
	size    int
	log     *slog.Logger

	ready    chan sandbox.Sandbox
	kick     chan struct{}
	mu       sync.Mutex
	inflight int
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

// PoolOptions configure a pool.
type PoolOptions struct {
	Size        int // boxes kept ready; 0 disables the pool
	Concurrency int // boxes created at once while refilling; default 1
	Logger      *slog.Logger
}

// NewPool starts filling a pool of boxes made from spec (its ID is
// replaced per box).
func NewPool(b sandbox.Backend, spec sandbox.Spec, opts PoolOptions) *Pool {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Concurrency <= 0 {
		opts.Concurrency = 1
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Pool{
		backend: b, spec: spec, size: opts.Size, log: opts.Logger,
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

func (p *Pool) create(ctx context.Context) (sandbox.Sandbox, error) {
	spec := p.spec
	spec.ID = newID()
	return p.backend.Create(ctx, spec)
}

func (p *Pool) fill() {
	defer p.wg.Done()
	backoff := 100 * time.Millisecond
	for p.ctx.Err() == nil {
		if !p.reserve() {
			select {
			case <-p.kick:
			case <-time.After(time.Second):
			case <-p.ctx.Done():
				return
			}
			continue
		}
		box, err := p.create(p.ctx)
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

// Get returns a fresh box: a pooled one if one is ready and alive, else a
// new one made now.
func (p *Pool) Get(ctx context.Context) (sandbox.Sandbox, error) {
	for {
		select {
		case box := <-p.ready:
			select {
			case p.kick <- struct{}{}:
			default:
			}
			select {
			case <-box.Done():
				box.Close() // died while waiting; take the next
				continue
			default:
				return box, nil
			}
		default:
			return p.create(ctx)
		}
	}
}

// Close stops refilling and destroys the ready boxes.
func (p *Pool) Close() {
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
