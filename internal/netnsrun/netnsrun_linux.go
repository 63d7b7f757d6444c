//go:build linux

// Package netnsrun runs code in another network namespace without moving
// the process: on an OS thread of its own that joins the namespace and
// then returns, so sockets made there stay there.
package netnsrun

import (
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

// In runs f on an OS thread that has joined ns, then returns the
// thread to the process's namespace. Sockets f creates stay in ns.
func In(ns netns.NsHandle, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("opening own network namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("entering network namespace: %w", err)
			return
		}
		ferr := f()
		if err := netns.Set(orig); err != nil {
			// Leave the thread locked: the runtime ends it with this
			// goroutine rather than reuse it in the wrong namespace.
			errc <- fmt.Errorf("leaving network namespace: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// New creates an anonymous network namespace, held only by the
// returned handle and whatever lives in it, so it vanishes with the process.
func New() (netns.NsHandle, error) {
	type result struct {
		ns  netns.NsHandle
		err error
	}
	c := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			c <- result{err: fmt.Errorf("opening own network namespace: %w", err)}
			return
		}
		defer orig.Close()
		ns, err := netns.New()
		if err != nil {
			if netns.Set(orig) == nil {
				runtime.UnlockOSThread()
			}
			c <- result{err: fmt.Errorf("creating network namespace: %w", err)}
			return
		}
		if err := netns.Set(orig); err != nil {
			ns.Close()
			c <- result{err: fmt.Errorf("leaving new network namespace: %w", err)}
			return
		}
		runtime.UnlockOSThread()
		c <- result{ns: ns}
	}()
	r := <-c
	return r.ns, r.err
}
