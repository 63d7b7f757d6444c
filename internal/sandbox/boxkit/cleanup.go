package boxkit

import (
	"errors"
	"sync"
)

// Cleanup is a last-in first-out stack of teardown steps: whoever builds
// something (a box, a VM, a gateway) pushes the step that undoes each part
// as soon as that part exists, and one Run undoes them all, in reverse, on
// failure halfway through building or at the end of its life. The zero
// value is an empty stack; it is safe for concurrent use.
type Cleanup struct {
	mu    sync.Mutex
	steps []func() error
	done  chan struct{} // made by the first Run, closed when it returns
	err   error
}

// Add pushes step. Once Run has started, step is too late for the stack
// and runs at once, its error joining what Run returns to later callers.
func (c *Cleanup) Add(step func() error) {
	c.mu.Lock()
	if c.done == nil {
		c.steps = append(c.steps, step)
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	if err := step(); err != nil {
		c.mu.Lock()
		c.err = errors.Join(c.err, err)
		c.mu.Unlock()
	}
}

// Run runs the steps, last pushed first, every one whatever the others
// return, and joins their errors. It runs them once: later calls wait for
// the first to finish and return its result. A step must not call Run.
func (c *Cleanup) Run() error {
	c.mu.Lock()
	if c.done != nil {
		done := c.done
		c.mu.Unlock()
		<-done
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.err
	}
	c.done = make(chan struct{})
	steps := c.steps
	c.steps = nil
	c.mu.Unlock()

	errs := make([]error, 0, len(steps))
	for i := len(steps) - 1; i >= 0; i-- {
		errs = append(errs, steps[i]())
	}
	err := errors.Join(errs...)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.err = errors.Join(c.err, err)
	close(c.done)
	return c.err
}
