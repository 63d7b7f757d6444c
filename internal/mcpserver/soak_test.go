package mcpserver_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
)

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// TestSoak runs thousands of calls from many concurrent clients against one
// server and reports leaked processes, fds, goroutines, memory and boxes
// (which must be zero) and p50/p99 latency over time. It is long: it runs
// only with KILN_SOAK=1 (KILN_SOAK_CALLS, KILN_SOAK_CLIENTS tune it).
//
//	KILN_SOAK=1 go test ./internal/mcpserver -run TestSoak -v -timeout 1h
func TestSoak(t *testing.T) {
	if os.Getenv("KILN_SOAK") != "1" {
		t.Skip("the soak runs with KILN_SOAK=1")
	}
	needRoot(t)
	calls, clients := envInt("KILN_SOAK_CALLS", 2000), envInt("KILN_SOAK_CLIENTS", 8)
	b, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(t)})
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	before := snapshot()
	mgr := session.NewManager(session.Options{
		Backend: b, DefaultTimeout: 30 * time.Second, Grace: time.Second,
		MaxSessions: 2 * clients, MaxSessionsPerPrincipal: 2 * clients, MaxBoxes: 2*clients + 2,
		PoolSize: 2, PoolWorkers: 2, MaxOutput: 2000,
	})
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: "jail"})

	type sample struct {
		at  time.Duration
		dur time.Duration
		ok  bool
	}
	var (
		mu      sync.Mutex
		samples []sample
		fails   []string
		next    int
	)
	start := time.Now()
	var wg sync.WaitGroup
	for c := range clients {
		cs := dial(t, srv)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer cs.Close() // before the leak check, not at the test's end
			name := fmt.Sprintf("soak-%d", c)
			for {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if i >= calls {
					return
				}
				tool, args, want := soakCall(i, name)
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				t0 := time.Now()
				res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
				d := time.Since(t0)
				cancel()
				ok := err == nil && !res.IsError && strings.Contains(text(res), want)
				mu.Lock()
				samples = append(samples, sample{at: t0.Sub(start), dur: d, ok: ok})
				if !ok && len(fails) < 10 {
					msg := fmt.Sprint(err)
					if res != nil {
						msg = text(res)
					}
					fails = append(fails, fmt.Sprintf("%s %v: %.300s", tool, args["code"], msg))
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	for _, n := range mgr.Sessions("local") {
		mgr.Reset("local", n)
	}
	mgr.Close()

	// Latency over time, in tenths of the run.
	slices.SortFunc(samples, func(a, b sample) int { return int(a.at - b.at) })
	failed := 0
	for _, s := range samples {
		if !s.ok {
			failed++
		}
	}
	t.Logf("%d calls from %d clients in %s (%.1f calls/s), %d failed", len(samples), clients, elapsed.Round(time.Millisecond), float64(len(samples))/elapsed.Seconds(), failed)
	for w := range 10 {
		lo, hi := len(samples)*w/10, len(samples)*(w+1)/10
		if hi <= lo {
			continue
		}
		var ds []time.Duration
		for _, s := range samples[lo:hi] {
			ds = append(ds, s.dur)
		}
		slices.Sort(ds)
		t.Logf("calls %5d-%5d (t=%6.1fs): p50 %7.1fms  p99 %7.1fms", lo, hi-1, samples[lo].at.Seconds(),
			ms(ds[len(ds)/2]), ms(ds[min(len(ds)-1, len(ds)*99/100)]))
	}
	for _, f := range fails {
		t.Errorf("failed call: %s", f)
	}

	// Leaks: wait for teardown to settle, then compare.
	var after snap
	var boxes []string
	deadline := time.Now().Add(30 * time.Second)
	for {
		runtime.GC()
		after, boxes = snapshot(), b.Leftovers()
		if (after.goroutines <= before.goroutines && after.fds <= before.fds && len(boxes) == 0) || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("leaks: processes/cgroups/mounts %d, fds %+d (%d → %d), goroutines %+d (%d → %d), heap %+.1f MiB, RSS %+.1f MiB",
		len(boxes), after.fds-before.fds, before.fds, after.fds, after.goroutines-before.goroutines, before.goroutines, after.goroutines,
		float64(int64(after.heap)-int64(before.heap))/(1<<20), float64(after.rss-before.rss)/(1<<10))
	for _, l := range boxes {
		t.Errorf("left behind: %s", l)
	}
	if after.fds > before.fds {
		t.Errorf("%d fds leaked", after.fds-before.fds)
	}
	if after.goroutines > before.goroutines {
		buf := make([]byte, 1<<20)
		t.Errorf("%d goroutines leaked:\n%s", after.goroutines-before.goroutines, buf[:runtime.Stack(buf, true)])
	}
}

// soakCall is the i-th call of a client: a mix of every tool.
func soakCall(i int, sess string) (tool string, args map[string]any, want string) {
	switch i % 8 {
	case 0, 1, 2:
		return "run_python", map[string]any{"session": sess, "code": fmt.Sprintf("n = %d\nn * 2", i)}, strconv.Itoa(2 * i)
	case 3:
		return "run_shell", map[string]any{"session": sess, "command": fmt.Sprintf("echo call-%d; (sleep 30 &)", i)}, fmt.Sprintf("call-%d", i)
	case 4:
		return "write_file", map[string]any{"session": sess, "path": fmt.Sprintf("d/f%d.txt", i%50), "content": strings.Repeat("k", 1000)}, "wrote"
	case 5:
		return "list_files", map[string]any{"session": sess}, "entries"
	case 6:
		return "run_python", map[string]any{"session": sess, "code": "import os\nprint(os.getpid())\n'ok'"}, "ok"
	}
	return "reset_session", map[string]any{"session": sess}, "[session: " + sess + "]"
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

type snap struct {
	goroutines, fds int
	heap            uint64
	rss             int64 // KiB
}

func snapshot() snap {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	fds, _ := os.ReadDir("/proc/self/fd")
	s := snap{goroutines: runtime.NumGoroutine(), fds: len(fds), heap: m.HeapAlloc}
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				s.rss, _ = strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			}
		}
	}
	return s
}
