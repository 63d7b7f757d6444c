package mcpserver_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"kiln/internal/mcpserver"
)

// TestHTTPLoadMeasure repeats the second hardening pass's load attacks
// against kiln's HTTP listener with the default limits and with none
// (main before the limits) and logs memory and a legitimate client's
// latency. It asserts nothing about the numbers; it runs only when
// KILN_HTTP_MEASURE=1:
//
//	KILN_HTTP_MEASURE=1 go test -count=1 -run TestHTTPLoadMeasure -v ./internal/mcpserver/
func TestHTTPLoadMeasure(t *testing.T) {
	if os.Getenv("KILN_HTTP_MEASURE") != "1" {
		t.Skip("a measurement; set KILN_HTTP_MEASURE=1 to run it")
	}
	none := mcpserver.HTTPLimits{HeaderTimeout: 10 * time.Second}
	for _, c := range []struct {
		name string
		lim  mcpserver.HTTPLimits
	}{{"no limits", none}, {"default limits", mcpserver.DefaultHTTPLimits()}} {
		t.Run(c.name, func(t *testing.T) {
			t.Run("40 concurrent 15 MB POSTs", func(t *testing.T) { measureBigPosts(t, c.lim) })
			t.Run("20000 initialize", func(t *testing.T) { measureInitFlood(t, c.lim) })
			t.Run("1500 idle connections", func(t *testing.T) { measureIdleConns(t, c.lim) })
		})
	}
}

func rssMiB() float64 {
	b, _ := os.ReadFile("/proc/self/status")
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	return 0
}

func heapMiB() float64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return float64(m.HeapInuse) / (1 << 20)
}

// sampler records the peak RSS and heap while it runs.
type sampler struct {
	stop            chan struct{}
	done            sync.WaitGroup
	peakRSS, peakHp float64
}

func sample() *sampler {
	s := &sampler{stop: make(chan struct{})}
	s.done.Add(1)
	go func() {
		defer s.done.Done()
		for {
			s.peakRSS, s.peakHp = max(s.peakRSS, rssMiB()), max(s.peakHp, heapMiB())
			select {
			case <-s.stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	return s
}

func (s *sampler) end() { close(s.stop); s.done.Wait() }

func measureBigPosts(t *testing.T, lim mcpserver.HTTPLimits) {
	f := startHTTP(t, lim)
	const n, size = 40, 15 << 20
	pad := initBody[:len(initBody)-1] + `,"pad":"` + strings.Repeat("x", size) + `"}`
	runtime.GC()
	rss0, heap0 := rssMiB(), heapMiB()
	s := sample()
	var wg sync.WaitGroup
	codes := make(chan int, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", "http://"+f.addr+"/mcp", strings.NewReader(pad))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Accept", "application/json, text/event-stream")
			req.Header.Set("Authorization", "Bearer "+f.secret)
			req.Header.Set("Expect", "100-continue") // as curl does
			resp, err := (&http.Client{Timeout: 5 * time.Minute, Transport: &http.Transport{ExpectContinueTimeout: time.Second}}).Do(req)
			if err != nil {
				codes <- 0
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes <- resp.StatusCode
		}()
	}
	time.Sleep(200 * time.Millisecond)
	lat := f.legit(t, "127.0.0.2")
	wg.Wait()
	close(codes)
	s.end()
	count := map[int]int{}
	for c := range codes {
		count[c]++
	}
	time.Sleep(2 * time.Second)
	runtime.GC()
	t.Logf("RSS %.0f MiB → peak %.0f → %.0f after; heap in use %.0f → peak %.0f → %.0f after GC; statuses %v; %d transport sessions live; legitimate client during the attack: %v",
		rss0, s.peakRSS, rssMiB(), heap0, s.peakHp, heapMiB(), count, f.liveSessions(), lat)
}

func measureInitFlood(t *testing.T, lim mcpserver.HTTPLimits) {
	f := startHTTP(t, lim)
	runtime.GC()
	heap0 := heapMiB()
	const n, workers = 20000, 16
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &http.Client{Timeout: 30 * time.Second}
			for i := w; i < n; i += workers {
				req, _ := http.NewRequest("POST", "http://"+f.addr+"/mcp", strings.NewReader(initBody))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Accept", "application/json, text/event-stream")
				req.Header.Set("Authorization", "Bearer "+f.secret)
				resp, err := c.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
	lat := f.legit(t, "127.0.0.2")
	runtime.GC()
	t.Logf("%d initialize calls: %d transport sessions live, heap in use %+.1f MiB after GC; legitimate client then: %v", n, f.liveSessions(), heapMiB()-heap0, lat)
}

func measureIdleConns(t *testing.T, lim mcpserver.HTTPLimits) {
	f := startHTTP(t, lim)
	const n = 1500
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range n {
		c, err := dialFrom("127.0.0.1", f.addr)
		if err != nil {
			t.Logf("dial: %v", err)
			break
		}
		conns = append(conns, c)
		fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: %s\r\n\r\n", f.addr)
	}
	for _, c := range conns {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
			resp.Body.Close()
		}
	}
	time.Sleep(time.Second)
	lat := f.legit(t, "127.0.0.2")
	open := len(conns) - countClosed(conns, 2*time.Second)
	t.Logf("%d GET /healthz connections from one address: %d still open after 1 s; legitimate client: %v", len(conns), open, lat)
}
