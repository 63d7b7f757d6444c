package session

import (
	"container/list"
	"sync"

	"kiln/internal/sandbox"
)

// slots is the cap on live boxes: one slot per box from before it is
// created until its Close has returned. Calls wait in line for a slot; the
// pool takes one only when it is free and no call is waiting, so refilling
// never delays a call.
type slots struct {
	max   int // 0: no cap
	freed chan struct{}

	mu      sync.Mutex
	used    int
	waiting list.List // of *slotWait, first come first served
}

func newSlots(max int) *slots {
	return &slots{max: max, freed: make(chan struct{}, 1)}
}

type slotWait struct {
	ready   chan struct{} // closed when the slot is granted
	granted bool
	elem    *list.Element
}

// wait queues for a slot; the returned wait's ready channel is closed once
// it is granted. Every wait ends in exactly one of release (after using a
// granted slot) or cancel.
func (s *slots) wait() *slotWait {
	w := &slotWait{ready: make(chan struct{})}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.max <= 0 || (s.used < s.max && s.waiting.Len() == 0) {
		s.used++
		w.granted = true
		close(w.ready)
		return w
	}
	w.elem = s.waiting.PushBack(w)
	return w
}

// cancel gives up a wait: its slot, if granted meanwhile, goes back.
func (s *slots) cancel(w *slotWait) {
	s.mu.Lock()
	if !w.granted {
		s.waiting.Remove(w.elem)
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	s.release()
}

// tryIdle takes a slot only if one is free and no call waits (the pool).
func (s *slots) tryIdle() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.max > 0 && (s.used >= s.max || s.waiting.Len() > 0) {
		return false
	}
	s.used++
	return true
}

// release frees a slot: the first waiting call gets it, else the pool is
// told.
func (s *slots) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.waiting.Front(); e != nil {
		w := s.waiting.Remove(e).(*slotWait)
		w.granted = true
		close(w.ready)
		return
	}
	s.used--
	select {
	case s.freed <- struct{}{}:
	default:
	}
}

// inUse is the number of slots held.
func (s *slots) inUse() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used
}

// countedBox holds its slot until the box is really gone: the slot is
// released after the backend's Close returns, not when the box is dropped.
type countedBox struct {
	sandbox.Sandbox
	once    sync.Once
	release func()
	err     error
}

func (b *countedBox) Close() error {
	b.once.Do(func() {
		b.err = b.Sandbox.Close()
		b.release()
	})
	return b.err
}

// The box's optional abilities stay visible through the wrapper.

func (b *countedBox) NetworkRefusals() []string {
	if r, ok := b.Sandbox.(sandbox.RefusalReporter); ok {
		return r.NetworkRefusals()
	}
	return nil
}

func (b *countedBox) OOMKilled() bool {
	o, ok := b.Sandbox.(sandbox.OOMReporter)
	return ok && o.OOMKilled()
}

// inner is the box a countedBox wraps, to ask which optional abilities
// its backend really has.
func inner(box sandbox.Sandbox) sandbox.Sandbox {
	if c, ok := box.(*countedBox); ok {
		return c.Sandbox
	}
	return box
}

var (
	_ sandbox.RefusalReporter = (*countedBox)(nil)
	_ sandbox.OOMReporter     = (*countedBox)(nil)
	_ sandbox.Sandbox         = (*countedBox)(nil)
)
