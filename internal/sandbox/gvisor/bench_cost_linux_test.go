package gvisor

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"kiln/internal/sandbox"
)

// The cost of a per-call box (issue 18), with the server's default
// preloads:
//
//	KILN_TEST_GVISOR=1 go test ./internal/sandbox/gvisor -run '^$' -bench 'Cost' -benchtime 20x
//
// CPU is counted two ways: the rusage of this process and every process it
// reaped (runsc reaps its sandbox and gofer, so the whole box is counted
// whatever cgroup runsc moved it into), and machine-wide from /proc/stat
// (which counts whatever else the machine does too).

var costPreload = []string{"numpy", "pandas", "matplotlib"}

// cpuNow is the user+system CPU of this process and its reaped children.
func cpuNow() time.Duration {
	var self, kids unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &self)
	unix.Getrusage(unix.RUSAGE_CHILDREN, &kids)
	tv := func(t unix.Timeval) time.Duration {
		return time.Duration(t.Sec)*time.Second + time.Duration(t.Usec)*time.Microsecond
	}
	return tv(self.Utime) + tv(self.Stime) + tv(kids.Utime) + tv(kids.Stime)
}

// machineCPU is the busy time of every CPU (/proc/stat, all but idle and
// iowait).
func machineCPU() time.Duration {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Scan()
	fields := strings.Fields(sc.Text())
	var busy int64
	for i, s := range fields[1:] {
		if i == 3 || i == 4 || i >= 8 { // idle, iowait, guest (counted in user)
			continue
		}
		n, _ := strconv.ParseInt(s, 10, 64)
		busy += n
	}
	return time.Duration(busy) * time.Second / 100 // USER_HZ
}

func costBackend(b *testing.B) (*Backend, sandbox.Spec) {
	be := newTestBackend(b, Options{})
	spec := sandbox.Spec{Preload: costPreload}
	if err := be.Warm(context.Background(), spec); err != nil {
		b.Fatal(err)
	}
	return be, spec
}

func perCall(b *testing.B, be *Backend, spec sandbox.Spec, id string) {
	spec.ID = id
	sb, err := be.Create(context.Background(), spec)
	if err != nil {
		b.Fatal(err)
	}
	if got := strings.TrimSpace(run(b, sb, "print(2+2)")); got != "4" {
		b.Fatalf("got %q", got)
	}
	if err := sb.Close(); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkCostPerCall is one per-call run after another: restore, run
// print(2+2), destroy.
func BenchmarkCostPerCall(b *testing.B) {
	be, spec := costBackend(b)
	perCall(b, be, spec, "cost-warmup")
	c0, m0, t0 := cpuNow(), machineCPU(), time.Now()
	i := 0
	for b.Loop() {
		i++
		perCall(b, be, spec, fmt.Sprintf("cost-%d", i))
	}
	n := float64(i)
	b.ReportMetric(float64((cpuNow()-c0).Milliseconds())/n, "ms-CPU-tree/op")
	b.ReportMetric(float64((machineCPU()-m0).Milliseconds())/n, "ms-CPU-machine/op")
	b.ReportMetric(n/time.Since(t0).Seconds(), "calls/s")
}

// BenchmarkCostThroughput runs per-call runs from 2 and 4 clients at once
// for b.N calls in all.
func BenchmarkCostThroughput(b *testing.B) {
	for _, clients := range []int{2, 4} {
		b.Run(strconv.Itoa(clients), func(b *testing.B) {
			be, spec := costBackend(b)
			perCall(b, be, spec, "cost-warmup")
			c0, m0, t0 := cpuNow(), machineCPU(), time.Now()
			var next atomic.Int64
			b.ResetTimer()
			var wg sync.WaitGroup
			for range clients {
				wg.Go(func() {
					for {
						i := next.Add(1)
						if i > int64(b.N) {
							return
						}
						perCall(b, be, spec, fmt.Sprintf("cost-%d", i))
					}
				})
			}
			wg.Wait()
			n := float64(b.N)
			b.ReportMetric(float64((cpuNow()-c0).Milliseconds())/n, "ms-CPU-tree/op")
			b.ReportMetric(float64((machineCPU()-m0).Milliseconds())/n, "ms-CPU-machine/op")
			b.ReportMetric(n/time.Since(t0).Seconds(), "calls/s")
		})
	}
}

// BenchmarkCostIdlePSS is the PSS of 4 idle restored boxes, each after one
// print(2+2), per box: the processes in its cgroup, and with its waiting
// runsc process.
func BenchmarkCostIdlePSS(b *testing.B) {
	be, spec := costBackend(b)
	for b.Loop() {
		var boxes []sandbox.Sandbox
		for i := range 4 {
			spec.ID = fmt.Sprintf("cost-pss-%d", i)
			sb, err := be.Create(context.Background(), spec)
			if err != nil {
				b.Fatal(err)
			}
			run(b, sb, "print(2+2)")
			boxes = append(boxes, sb)
		}
		time.Sleep(time.Second)
		var boxKB, totalKB float64
		be.mu.Lock()
		for _, bx := range be.boxes {
			var cg float64
			for _, pid := range boxPids(bx) {
				cg += float64(pssKB(pid))
			}
			boxKB += cg
			totalKB += cg + float64(pssKB(bx.cmd.Process.Pid))
		}
		be.mu.Unlock()
		for _, sb := range boxes {
			sb.Close()
		}
		b.ReportMetric(boxKB/4/1024, "MiB-PSS-box")
		b.ReportMetric(totalKB/4/1024, "MiB-PSS-total")
	}
}
