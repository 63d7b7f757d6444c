package boxkit

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// fakeTemplates builds numbered templates and records which were stopped.
type fakeTemplates struct {
	builds  atomic.Int32
	fail    atomic.Bool
	release chan struct{} // builds wait for it, when set
	mu      sync.Mutex
	stopped map[int]bool
	dead    map[int]bool
}

func newFakeTemplates() *fakeTemplates {
	return &fakeTemplates{stopped: map[int]bool{}, dead: map[int]bool{}}
}

func (f *fakeTemplates) build(ctx context.Context, replacing bool) (int, time.Time, error) {
	n := int(f.builds.Add(1))
	if f.release != nil {
		select {
		case <-f.release:
		case <-ctx.Done():
			return 0, time.Time{}, ctx.Err()
		}
	}
	if f.fail.Load() {
		return 0, time.Time{}, errors.New("boom")
	}
	return n, time.Time{}, nil
}

func (f *fakeTemplates) opts(r Rotation) TemplateOptions[int] {
	return TemplateOptions[int]{
		Stop: func(n int) {
			f.mu.Lock()
			f.stopped[n] = true
			f.mu.Unlock()
		},
		Dead: func(n int) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			if f.dead[n] {
				return errors.New("exited")
			}
			return nil
		},
		Rotation: r,
	}
}

func (f *fakeTemplates) isStopped(n int) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stopped[n]
}

// Callers that ask at the same time share one build.
func TestTemplateSingleFlight(t *testing.T) {
	f := newFakeTemplates()
	f.release = make(chan struct{})
	c := NewTemplateCache(f.opts(Rotation{}))
	defer c.Close()
	var wg sync.WaitGroup
	got := make(chan int, 10)
	for range 10 {
		wg.Go(func() {
			tpl, err := c.Get(context.Background(), "k", f.build)
			if err != nil {
				t.Error(err)
				return
			}
			got <- tpl.Value
			c.Release(tpl)
		})
	}
	time.Sleep(50 * time.Millisecond)
	close(f.release)
	wg.Wait()
	close(got)
	for v := range got {
		if v != 1 {
			t.Errorf("a caller got template %d", v)
		}
	}
	if n := f.builds.Load(); n != 1 {
		t.Errorf("%d builds for one key", n)
	}
	if st := c.Stats(); st.SyncStarts != 1 || st.Waits != 10 {
		t.Errorf("stats %+v", st)
	}
}

// A failed build is not cached: the next call builds again.
func TestTemplateFailureNotCached(t *testing.T) {
	f := newFakeTemplates()
	c := NewTemplateCache(f.opts(Rotation{}))
	defer c.Close()
	f.fail.Store(true)
	if _, err := c.Get(context.Background(), "k", f.build); err == nil {
		t.Fatal("want the build's error")
	}
	f.fail.Store(false)
	tpl, err := c.Get(context.Background(), "k", f.build)
	if err != nil {
		t.Fatal(err)
	}
	c.Release(tpl)
	if n := f.builds.Load(); n != 2 {
		t.Errorf("%d builds, want 2", n)
	}
}

// With KeepFailure, a failure is remembered for a while, then retried.
func TestTemplateKeepFailure(t *testing.T) {
	f := newFakeTemplates()
	o := f.opts(Rotation{})
	o.KeepFailure = 100 * time.Millisecond
	c := NewTemplateCache(o)
	defer c.Close()
	f.fail.Store(true)
	if err := c.Warm(context.Background(), "k", f.build); err == nil {
		t.Fatal("want the build's error")
	}
	f.fail.Store(false)
	if tpl := c.Ready("k", f.build); tpl != nil || f.builds.Load() != 1 {
		t.Fatalf("a kept failure was retried at once: %v, %d builds", tpl, f.builds.Load())
	}
	time.Sleep(150 * time.Millisecond)
	if err := c.Warm(context.Background(), "k", f.build); err != nil {
		t.Fatal(err)
	}
	tpl := c.Ready("k", f.build)
	if tpl == nil {
		t.Fatal("no ready template after a successful warm-up")
	}
	c.Release(tpl)
}

// Ready never waits: it starts the build and returns nil until it is done.
func TestTemplateReady(t *testing.T) {
	f := newFakeTemplates()
	f.release = make(chan struct{})
	c := NewTemplateCache(f.opts(Rotation{}))
	defer c.Close()
	if tpl := c.Ready("k", f.build); tpl != nil {
		t.Fatal("ready before its build")
	}
	close(f.release)
	if err := c.Warm(context.Background(), "k", f.build); err != nil {
		t.Fatal(err)
	}
	if tpl := c.Ready("k", f.build); tpl == nil || tpl.Value != 1 {
		t.Fatalf("Ready = %v", tpl)
	}
}

// After MaxUses a fresh template, built in the background, serves; the
// old one is stopped once its last use is released, not before.
func TestTemplateRotation(t *testing.T) {
	f := newFakeTemplates()
	c := NewTemplateCache(f.opts(Rotation{MaxUses: 2}))
	defer c.Close()
	ctx := context.Background()
	a, _ := c.Get(ctx, "k", f.build)
	b, _ := c.Get(ctx, "k", f.build)
	if a.Value != 1 || b.Value != 1 {
		t.Fatalf("first two uses from %d and %d", a.Value, b.Value)
	}
	if err := c.WaitRotations(ctx, 1); err != nil {
		t.Fatal(err)
	}
	d, _ := c.Get(ctx, "k", f.build)
	if d.Value != 2 {
		t.Errorf("third use from template %d, want the replacement", d.Value)
	}
	c.Release(a)
	if f.isStopped(1) {
		t.Error("template 1 stopped while a use of it is live")
	}
	c.Release(b)
	c.Release(d)
	time.Sleep(20 * time.Millisecond)
	if !f.isStopped(1) || f.isStopped(2) {
		t.Errorf("stopped: %v", f.stopped)
	}
	if st := c.Stats(); st.SyncStarts != 1 || st.BackgroundStarts != 1 || st.Rotations != 1 {
		t.Errorf("stats %+v", st)
	}
}

// MaxAge with ReplaceIdle replaces a template no one uses.
func TestTemplateRotationByAge(t *testing.T) {
	f := newFakeTemplates()
	c := NewTemplateCache(f.opts(Rotation{MaxAge: 50 * time.Millisecond, ReplaceIdle: true}))
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Warm(ctx, "k", f.build); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitRotations(ctx, 1); err != nil {
		t.Fatal(err)
	}
	tpl, _ := c.Get(ctx, "k", f.build)
	if tpl.Value == 1 {
		t.Error("the template past its age still serves")
	}
	c.Release(tpl)
}

// A template that died is replaced by the next call.
func TestTemplateDead(t *testing.T) {
	f := newFakeTemplates()
	c := NewTemplateCache(f.opts(Rotation{}))
	defer c.Close()
	ctx := context.Background()
	tpl, _ := c.Get(ctx, "k", f.build)
	c.Release(tpl)
	f.mu.Lock()
	f.dead[1] = true
	f.mu.Unlock()
	tpl, err := c.Get(ctx, "k", f.build)
	if err != nil || tpl.Value != 2 {
		t.Fatalf("after a death: %v, %v", tpl, err)
	}
	c.Release(tpl)
}

// Close cancels builds under way, stops every template, in use or not,
// and refuses later calls.
func TestTemplateClose(t *testing.T) {
	f := newFakeTemplates()
	c := NewTemplateCache(f.opts(Rotation{}))
	ctx := context.Background()
	a, _ := c.Get(ctx, "a", f.build) // kept in use
	f.release = make(chan struct{})  // the next build hangs
	go c.Get(ctx, "b", f.build)
	for f.builds.Load() < 2 {
		time.Sleep(time.Millisecond)
	}
	c.Close()
	if !f.isStopped(a.Value) {
		t.Error("Close left a template in use running")
	}
	if _, err := c.Get(ctx, "a", f.build); !errors.Is(err, sandbox.ErrClosed) {
		t.Errorf("Get after Close: %v", err)
	}
}

// KeepInUseOnClose stops a template in use when it is released.
func TestTemplateCloseKeepsInUse(t *testing.T) {
	f := newFakeTemplates()
	o := f.opts(Rotation{})
	o.KeepInUseOnClose = true
	c := NewTemplateCache(o)
	a, _ := c.Get(context.Background(), "a", f.build)
	c.Close()
	if f.isStopped(1) {
		t.Fatal("Close stopped a template in use")
	}
	c.Release(a)
	time.Sleep(20 * time.Millisecond)
	if !f.isStopped(1) {
		t.Error("a template released after Close was not stopped")
	}
}

// A replacement that Close interrupts is not a failure worth a warning.
func TestTemplateCloseDuringReplacement(t *testing.T) {
	f := newFakeTemplates()
	var logs strings.Builder
	o := f.opts(Rotation{MaxUses: 1})
	o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	c := NewTemplateCache(o)
	// The first build succeeds, the replacement hangs until Close.
	build := func(ctx context.Context, replacing bool) (int, time.Time, error) {
		if replacing {
			f.builds.Add(1)
			<-ctx.Done()
			return 0, time.Time{}, ctx.Err()
		}
		return f.build(ctx, replacing)
	}
	tpl, err := c.Get(context.Background(), "k", build)
	if err != nil {
		t.Fatal(err)
	}
	for f.builds.Load() < 2 {
		time.Sleep(time.Millisecond)
	}
	c.Release(tpl)
	c.Close()
	if logs.Len() != 0 {
		t.Errorf("Close during a replacement logged:\n%s", logs.String())
	}
}
