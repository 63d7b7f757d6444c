package boxkit

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"kiln/internal/sandbox"
)

// A template is what a backend makes boxes from: a zygote process that
// forks them, a VM snapshot they are restored from, a checkpoint. Making
// one is slow (a boot, a python that imports its libraries), so a backend
// keeps one per key (the shape of its boxes) in a TemplateCache, which
// builds it once however many calls ask at the same time, and replaces it
// after a bounded use (rotate.go).

// TemplateBuild makes a key's template, off any call's path, on a context
// that ends when the cache is closed. replacing is true for a rotation's
// replacement, which must be made afresh rather than loaded from what an
// earlier one left. born is when the template was made (zero: now); its
// age counts from then.
type TemplateBuild[T any] func(ctx context.Context, replacing bool) (v T, born time.Time, err error)

// TemplateOptions tune a TemplateCache. Zero values mean no rotation and
// nothing to stop.
type TemplateOptions[T any] struct {
	// Name says what the templates are, in logs ("jail zygote").
	Name string
	// Stop releases a template: it is called once per built template,
	// without the cache's lock, when the template is retired and its
	// last user released it, when it died, or at Close. It may block
	// until the template is gone; Close waits for it.
	Stop func(T)
	// Dead, if set, says why a template died (nil: it is alive). A dead
	// template is replaced by the next Get. It is called with the cache's
	// lock held and must not block.
	Dead func(T) error
	// KeepFailure is how long a failed build's error is returned to
	// callers before a new build is tried; zero: the next Get tries
	// again.
	KeepFailure time.Duration
	// KeepInUseOnClose makes Close stop templates in use only when their
	// last user releases them (a restore under way still reads the
	// template); by default Close stops every template at once (boxes
	// that live inside it die with it).
	KeepInUseOnClose bool

	Rotation
	Logger *slog.Logger
}

// TemplateCache keeps one template per key. The first Get of a key starts
// its build and every Get of that key until it is ready waits for the same
// build; a failed build is forgotten (after KeepFailure), so a later Get
// tries again. It is safe for concurrent use.
type TemplateCache[T any] struct {
	opts   TemplateOptions[T]
	log    *slog.Logger
	ctx    context.Context // builds'; cancelled by Close
	cancel context.CancelFunc

	mu     sync.Mutex
	cur    map[string]*Template[T]
	closed bool
	rot    rotation[T] // guarded by mu
	builds sync.WaitGroup
	stops  sync.WaitGroup
	// stopsWaited: Close has waited for stops; later ones (templates
	// in use at Close) are not waited for.
	stopsWaited bool
	changed     chan struct{} // closed and renewed when a key's template changes
}

// Template is a template of a cache, handed out by Get; its Value is set.
type Template[T any] struct {
	Value T

	key   string
	build TemplateBuild[T]
	ready chan struct{} // closed once Value or err is set
	err   error
	done  time.Time // when the build ended

	// Guarded by the cache's mu.
	born    time.Time
	served  int // uses asked of it
	users   int // uses not released yet
	retired bool
	stopped bool
	timer   *time.Timer
}

// Key is the key the template was built for.
func (t *Template[T]) Key() string { return t.key }

func (t *Template[T]) isReady() bool {
	select {
	case <-t.ready:
		return true
	default:
		return false
	}
}

// NewTemplateCache returns an empty cache.
func NewTemplateCache[T any](opts TemplateOptions[T]) *TemplateCache[T] {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Name == "" {
		opts.Name = "template"
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &TemplateCache[T]{
		opts:    opts,
		log:     opts.Logger,
		ctx:     ctx,
		cancel:  cancel,
		cur:     map[string]*Template[T]{},
		changed: make(chan struct{}),
	}
	c.rot.init(opts.Rotation)
	return c
}

// Get returns key's ready template, building it with build if there is
// none, and counts a use of it: the caller calls Release once done with
// it. A caller that gives up (ctx) does not stop the build.
func (c *TemplateCache[T]) Get(ctx context.Context, key string, build TemplateBuild[T]) (*Template[T], error) {
	waited := false
	for {
		c.mu.Lock()
		t, err := c.currentLocked(key, build)
		if err != nil {
			c.mu.Unlock()
			return nil, err
		}
		if !t.isReady() && !waited {
			waited = true
			c.rot.stats.Waits++
		}
		c.mu.Unlock()
		select {
		case <-t.ready:
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for %s: %w", c.opts.Name, ctx.Err())
		}
		if t.err != nil {
			c.mu.Lock()
			c.forgetFailureLocked(t)
			c.mu.Unlock()
			return nil, t.err
		}
		c.mu.Lock()
		if t.retired || c.cur[key] != t {
			c.mu.Unlock()
			continue // replaced while we waited
		}
		c.useLocked(t)
		c.mu.Unlock()
		return t, nil
	}
}

// Ready is Get for a caller that will not wait: it returns key's template
// if it is ready (counting a use, to Release), and otherwise nil, having
// started its build in the background if none was under way.
func (c *TemplateCache[T]) Ready(key string, build TemplateBuild[T]) *Template[T] {
	c.mu.Lock()
	defer c.mu.Unlock()
	t, err := c.currentLocked(key, build)
	if err != nil || !t.isReady() || t.err != nil {
		return nil
	}
	c.useLocked(t)
	return t
}

// Warm builds key's template now, if it is not there, and waits until it
// is ready, without counting a use: what a server calls at start.
func (c *TemplateCache[T]) Warm(ctx context.Context, key string, build TemplateBuild[T]) error {
	c.mu.Lock()
	t, err := c.currentLocked(key, build)
	c.mu.Unlock()
	if err != nil {
		return err
	}
	select {
	case <-t.ready:
	case <-ctx.Done():
		return fmt.Errorf("waiting for %s: %w", c.opts.Name, ctx.Err())
	}
	if t.err != nil {
		c.mu.Lock()
		c.forgetFailureLocked(t)
		c.mu.Unlock()
	}
	return t.err
}

// currentLocked returns key's current template, ready or not: a ready
// replacement takes over an exhausted one, a dead one or a failure whose
// time is up is forgotten, and a build starts when there is none.
func (c *TemplateCache[T]) currentLocked(key string, build TemplateBuild[T]) (*Template[T], error) {
	if c.closed {
		return nil, sandbox.ErrClosed
	}
	t := c.cur[key]
	if t != nil && t.isReady() {
		switch {
		case t.err != nil:
			if time.Since(t.done) >= c.opts.KeepFailure {
				delete(c.cur, key)
				t = nil
			}
		case c.opts.Dead != nil:
			if err := c.opts.Dead(t.Value); err != nil {
				c.log.Warn(c.opts.Name+" died; making a new one", "key", key, "err", err)
				delete(c.cur, key)
				c.retireLocked(t)
				t = nil
			}
		}
	}
	if nt := c.rot.next[key]; nt != nil && (t == nil || c.exhaustedLocked(t)) {
		t = c.swapLocked(key)
	}
	if t == nil {
		t = c.startLocked(key, build, false)
		c.rot.stats.SyncStarts++
		c.cur[key] = t
	}
	return t, nil
}

// forgetFailureLocked drops a failed build at once when failures are not
// kept, so that the next Get tries again.
func (c *TemplateCache[T]) forgetFailureLocked(t *Template[T]) {
	if c.opts.KeepFailure <= 0 && c.cur[t.key] == t {
		delete(c.cur, t.key)
	}
}

// useLocked counts a use of the ready template t, and starts its
// replacement when it is due.
func (c *TemplateCache[T]) useLocked(t *Template[T]) {
	if c.exhaustedLocked(t) {
		c.rot.stats.Overserved++
	}
	t.served++
	t.users++
	if c.dueLocked(t) {
		c.replaceLocked(t.key)
	}
}

// Release ends a use of t that Get or Ready counted.
func (c *TemplateCache[T]) Release(t *Template[T]) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t.users--
	if t.retired && t.users <= 0 {
		c.stopLocked(t)
	}
}

// Drop forgets t, which failed its user (a saved template that does not
// load): the next Get builds key's template again. t is stopped once its
// last user released it.
func (c *TemplateCache[T]) Drop(t *Template[T]) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur[t.key] == t {
		delete(c.cur, t.key)
	}
	c.retireLocked(t)
}

// Values returns the ready templates the cache holds, current, replacing
// or retired: what must not be removed from under it.
func (c *TemplateCache[T]) Values() []T {
	c.mu.Lock()
	defer c.mu.Unlock()
	var vs []T
	for _, t := range c.allLocked() {
		if t.isReady() && t.err == nil && !t.stopped {
			vs = append(vs, t.Value)
		}
	}
	return vs
}

// startLocked starts building a template of key in the background.
func (c *TemplateCache[T]) startLocked(key string, build TemplateBuild[T], replacing bool) *Template[T] {
	t := &Template[T]{key: key, build: build, ready: make(chan struct{})}
	c.builds.Add(1)
	go func() {
		defer c.builds.Done()
		v, born, err := build(c.ctx, replacing)
		c.mu.Lock()
		defer c.mu.Unlock()
		t.Value, t.err, t.done = v, err, time.Now()
		if born.IsZero() {
			born = t.done
		}
		t.born = born
		close(t.ready)
		if c.closed || t.retired {
			c.stopLocked(t) // built after Close, or replaced while built
			return
		}
		if replacing {
			c.landLocked(t)
		} else if err == nil {
			c.trackLocked(t)
		}
	}()
	return t
}

// retireLocked makes t serve no more uses; it is stopped once unused.
func (c *TemplateCache[T]) retireLocked(t *Template[T]) {
	if t.timer != nil {
		t.timer.Stop()
	}
	t.retired = true
	c.rot.retired[t] = struct{}{}
	if t.users <= 0 {
		c.stopLocked(t)
	}
}

// stopLocked stops a built template once, in the background.
func (c *TemplateCache[T]) stopLocked(t *Template[T]) {
	delete(c.rot.retired, t)
	if t.timer != nil {
		t.timer.Stop()
	}
	if t.stopped || !t.isReady() || t.err != nil {
		return
	}
	t.stopped = true
	if c.opts.Stop == nil {
		return
	}
	if c.stopsWaited {
		go c.opts.Stop(t.Value) // released after Close
		return
	}
	c.stops.Add(1)
	go func() {
		defer c.stops.Done()
		c.opts.Stop(t.Value)
	}()
}

// allLocked lists every template: current, replacements and retired.
func (c *TemplateCache[T]) allLocked() []*Template[T] {
	var all []*Template[T]
	for _, t := range c.cur {
		all = append(all, t)
	}
	for _, t := range c.rot.next {
		if t != nil {
			all = append(all, t)
		}
	}
	for t := range c.rot.retired {
		all = append(all, t)
	}
	return all
}

// Close stops the builds under way and the templates: every one at once,
// or (KeepInUseOnClose) those in use when their last user releases them.
// It waits for the builds and for the stops it made.
func (c *TemplateCache[T]) Close() {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	c.cancel()
	for _, t := range c.allLocked() {
		if c.opts.KeepInUseOnClose && t.users > 0 {
			c.retireLocked(t)
			continue
		}
		c.stopLocked(t)
	}
	clear(c.cur)
	clear(c.rot.next)
	c.mu.Unlock()
	c.builds.Wait() // a build that ends after Close stops its template
	c.mu.Lock()
	c.stopsWaited = true
	c.mu.Unlock()
	c.stops.Wait()
}
