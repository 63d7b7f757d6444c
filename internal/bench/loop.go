package bench

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// loopResult is what a closed loop of clients did.
type loopResult struct {
	samples  []time.Duration // latencies of the calls that succeeded
	failed   int
	firstErr error
	elapsed  time.Duration
}

// closedLoop runs call from n concurrent clients, each calling again as
// soon as its last call returns, until d has passed or ctx ends.
func closedLoop(ctx context.Context, n int, d time.Duration, call func() error) loopResult {
	var (
		mu  sync.Mutex
		res loopResult
		wg  sync.WaitGroup
	)
	start := time.Now()
	deadline := start.Add(d)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) && ctx.Err() == nil {
				t0 := time.Now()
				err := call()
				took := time.Since(t0)
				mu.Lock()
				if err != nil {
					res.failed++
					if res.firstErr == nil {
						res.firstErr = err
					}
				} else {
					res.samples = append(res.samples, took)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	return res
}

// measurement is the loop's throughput row; what names the calls in the
// error of a loop with failures ("calls", "spawns").
func (l loopResult) measurement(key, name, what string) Measurement {
	p50, p99 := percentiles(l.samples)
	m := Measurement{Key: key, Name: name, Unit: "calls/s", N: len(l.samples),
		P50:  float64(len(l.samples)) / l.elapsed.Seconds(),
		Note: fmt.Sprintf("latency p50 %.1f ms, p99 %.1f ms", p50, p99)}
	if l.failed > 0 {
		m.Err = fmt.Sprintf("%d %s failed, first: %v", l.failed, what, l.firstErr)
	}
	return m
}
