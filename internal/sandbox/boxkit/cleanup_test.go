package boxkit

import (
	"errors"
	"slices"
	"sync"
	"testing"
)

// TestCleanupOrder: steps run last pushed first, all of them despite
// errors, whose join Run returns; a second Run runs nothing again and
// returns the same.
func TestCleanupOrder(t *testing.T) {
	var c Cleanup
	var ran []int
	e1, e3 := errors.New("one"), errors.New("three")
	c.Add(func() error { ran = append(ran, 1); return e1 })
	c.Add(func() error { ran = append(ran, 2); return nil })
	c.Add(func() error { ran = append(ran, 3); return e3 })
	err := c.Run()
	if !slices.Equal(ran, []int{3, 2, 1}) {
		t.Errorf("ran %v; want [3 2 1]", ran)
	}
	if !errors.Is(err, e1) || !errors.Is(err, e3) {
		t.Errorf("Run = %v; want both errors", err)
	}
	if err2 := c.Run(); err2 == nil || err2.Error() != err.Error() || len(ran) != 3 {
		t.Errorf("second Run = %v after running %v; want %v and nothing run", err2, ran, err)
	}
}

// TestCleanupLate: a step pushed after Run runs at once.
func TestCleanupLate(t *testing.T) {
	var c Cleanup
	if err := c.Run(); err != nil {
		t.Fatalf("Run of an empty stack = %v", err)
	}
	late := errors.New("late")
	ran := false
	c.Add(func() error { ran = true; return late })
	if !ran {
		t.Fatal("a step pushed after Run did not run")
	}
	if err := c.Run(); !errors.Is(err, late) {
		t.Errorf("Run after a late step = %v; want its error", err)
	}
}

// TestCleanupConcurrent: of many concurrent Runs, the steps run once and
// every caller returns only after they have.
func TestCleanupConcurrent(t *testing.T) {
	var c Cleanup
	var mu sync.Mutex
	n := 0
	release := make(chan struct{})
	c.Add(func() error { <-release; mu.Lock(); n++; mu.Unlock(); return nil })
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			c.Run()
			mu.Lock()
			defer mu.Unlock()
			if n != 1 {
				t.Errorf("Run returned with the step run %d times", n)
			}
		})
	}
	close(release)
	wg.Wait()
}
