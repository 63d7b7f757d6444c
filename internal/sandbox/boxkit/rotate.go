package boxkit

import (
	"context"
	"time"
)

// Template rotation. Every box made from one template starts as a copy of
// its memory, so boxes of one template share what was fixed when it
// started and cannot be changed in a running process (where libraries are
// mapped, stack canaries, python's string-hash seed); the backends say
// what in their own words. What is shared is bounded instead: a template
// serves at most MaxUses boxes and is used for at most MaxAge, then a
// fresh one replaces it.
//
// Rotation is off the call path. The replacement is built in the
// background when the current template has served three quarters of its
// boxes or reached its age; until the replacement is ready the current one
// keeps serving (a burst can take it a little past its count), and then
// they swap under the lock. A call only ever waits for a build when there
// is no template, or the one there died, with no ready replacement: the
// first call, or after a crash. A replaced template is retired, serves no
// more boxes, and is stopped when its last user releases it.

// DefaultRetryRotation is how long a failed replacement is not retried.
const DefaultRetryRotation = 30 * time.Second

// Rotation bounds a template's use; zero values mean no bound.
type Rotation struct {
	MaxUses int           // boxes one template serves
	MaxAge  time.Duration // how long one template is used, from when it was made
	// ReplaceIdle replaces a template at MaxAge even when no box is
	// asked of it, so that the next call finds a fresh one ready.
	ReplaceIdle bool
	// RetryAfter is how long a failed replacement is not retried;
	// default DefaultRetryRotation.
	RetryAfter time.Duration
}

// TemplateStats counts what a cache did, for tests and logs.
type TemplateStats struct {
	SyncStarts       int // builds a call waited for (the first, or after a death or a failure)
	BackgroundStarts int // replacements started off the call path
	Waits            int // calls that found their template not ready yet
	Rotations        int // replacements that became current
	Overserved       int // uses of a template beyond its bounds, while its replacement was built
	Failed           int // replacements that could not be made
}

// rotation is a cache's replacement state; guarded by the cache's mu.
type rotation[T any] struct {
	Rotation
	// next holds replacements: present with nil while one is built, then
	// the ready template until it becomes current.
	next       map[string]*Template[T]
	retryAfter map[string]time.Time
	retired    map[*Template[T]]struct{} // replaced, serving uses they made
	stats      TemplateStats
}

func (r *rotation[T]) init(o Rotation) {
	r.Rotation = o
	r.MaxUses = max(r.MaxUses, 0)
	r.MaxAge = max(r.MaxAge, 0)
	if r.RetryAfter <= 0 {
		r.RetryAfter = DefaultRetryRotation
	}
	r.next = map[string]*Template[T]{}
	r.retryAfter = map[string]time.Time{}
	r.retired = map[*Template[T]]struct{}{}
}

// Stats reports what the cache did.
func (c *TemplateCache[T]) Stats() TemplateStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rot.stats
}

// WaitRotations waits until n replacements have become current.
func (c *TemplateCache[T]) WaitRotations(ctx context.Context, n int) error {
	for {
		c.mu.Lock()
		done, ch := c.rot.stats.Rotations >= n, c.changed
		c.mu.Unlock()
		if done {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// exhaustedLocked says t must serve no more once a replacement is ready.
func (c *TemplateCache[T]) exhaustedLocked(t *Template[T]) bool {
	return (c.rot.MaxUses > 0 && t.served >= c.rot.MaxUses) ||
		(c.rot.MaxAge > 0 && time.Since(t.born) >= c.rot.MaxAge)
}

// dueLocked says t's replacement should be started now: t has served
// three quarters of its uses, or is exhausted.
func (c *TemplateCache[T]) dueLocked(t *Template[T]) bool {
	n := c.rot.MaxUses
	return (n > 0 && t.served >= n-n/4) || c.exhaustedLocked(t)
}

// trackLocked arms t's age limit, when idle templates are replaced.
func (c *TemplateCache[T]) trackLocked(t *Template[T]) {
	if c.rot.MaxAge <= 0 || !c.rot.ReplaceIdle {
		return
	}
	t.timer = time.AfterFunc(max(c.rot.MaxAge-time.Since(t.born), 0), func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.cur[t.key] == t && !c.closed {
			c.replaceLocked(t.key)
		}
	})
}

// replaceLocked starts building a replacement for key's template in the
// background, unless one is already under way or waiting, or failed
// recently.
func (c *TemplateCache[T]) replaceLocked(key string) {
	cur := c.cur[key]
	if _, ok := c.rot.next[key]; ok || cur == nil || time.Now().Before(c.rot.retryAfter[key]) {
		return
	}
	c.rot.next[key] = nil
	c.rot.stats.BackgroundStarts++
	c.log.Info("replacing "+c.opts.Name, "key", key, "served", cur.served, "age", time.Since(cur.born).Round(time.Second))
	c.startLocked(key, cur.build, true)
}

// landLocked takes a built replacement: it waits in next until the
// current template is exhausted (or gone), or takes over now if it is.
func (c *TemplateCache[T]) landLocked(nt *Template[T]) {
	key := nt.key
	if nt.err != nil {
		delete(c.rot.next, key)
		c.rot.retryAfter[key] = time.Now().Add(c.rot.RetryAfter)
		c.rot.stats.Failed++
		c.log.Warn("replacing "+c.opts.Name+" failed; the current one keeps serving", "key", key, "err", nt.err)
		return
	}
	c.trackLocked(nt)
	c.rot.next[key] = nt
	cur := c.cur[key]
	if cur == nil || !cur.isReady() || cur.err != nil || c.exhaustedLocked(cur) ||
		(c.opts.Dead != nil && c.opts.Dead(cur.Value) != nil) {
		c.swapLocked(key)
	}
}

// swapLocked makes key's ready replacement current, retires the old
// template, and returns the new one.
func (c *TemplateCache[T]) swapLocked(key string) *Template[T] {
	nt := c.rot.next[key]
	delete(c.rot.next, key)
	if old := c.cur[key]; old != nil {
		c.retireLocked(old)
		c.log.Debug(c.opts.Name+" replaced", "key", key, "served", old.served, "age", time.Since(old.born).Round(time.Millisecond))
	}
	c.cur[key] = nt
	c.rot.stats.Rotations++
	close(c.changed)
	c.changed = make(chan struct{})
	return nt
}
