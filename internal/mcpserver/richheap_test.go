package mcpserver_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"net"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/mcpserver"
	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// floodBackend's boxes answer every exec with one prepared frame body: a
// box whose agent ignores the rich-output bound.
type floodBackend struct{ body []byte }

func (floodBackend) Name() string { return "flood" }

func (floodBackend) Close() error { return nil }

func (b floodBackend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	host, guest := net.Pipe()
	go func() {
		defer guest.Close()
		var hello bytes.Buffer
		agentproto.WriteFrame(&hello, &agentproto.Hello{Version: 1})
		if _, err := guest.Write(hello.Bytes()); err != nil {
			return
		}
		for {
			var req agentproto.Request
			if agentproto.ReadFrame(guest, &req) != nil {
				return
			}
			// The body starts with {"id": and ten spaces, patched per
			// request.
			var hdr [4]byte
			binary.BigEndian.PutUint32(hdr[:], uint32(len(b.body)))
			id := []byte(`{"id":` + strings.Repeat(" ", 10))
			idStr := []byte(strconv.FormatUint(req.ID, 10))
			copy(id[len(id)-len(idStr):], idStr)
			if _, err := guest.Write(hdr[:]); err != nil {
				return
			}
			if _, err := guest.Write(id); err != nil {
				return
			}
			if _, err := guest.Write(b.body[len(id):]); err != nil {
				return
			}
		}
	}()
	c, err := sandbox.NewAgentConn(ctx, spec.ID, host, func() error { guest.Close(); return nil })
	if err != nil {
		return nil, err
	}
	return c, nil
}

// htmlFlood is a response body with n bytes of HTML spread over displays
// of at most 7.5 MiB each (under the driver's cap per representation), as
// JSON without HTML escaping.
func htmlFlood(n int) []byte {
	row := "<tr><td>1234</td><td>abcd</td></tr>\n"
	var displays []agentproto.MimeBundle
	for left := n; left > 0; {
		k := min(left, 15<<19)
		displays = append(displays, agentproto.MimeBundle{"text/html": strings.Repeat(row, k/len(row)+1)[:k], "text/plain": "<table>"})
		left -= k
	}
	var buf bytes.Buffer
	buf.WriteString(`{"id":` + strings.Repeat(" ", 10) + `,"exec":`)
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.Encode(&agentproto.ExecResult{Displays: displays})
	buf.WriteString("}")
	return buf.Bytes()
}

// peakHeap samples the heap in use until stop is closed.
func peakHeap(stop <-chan struct{}) <-chan uint64 {
	out := make(chan uint64, 1)
	go func() {
		var peak uint64
		var ms runtime.MemStats
		for {
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse)
			select {
			case <-stop:
				out <- peak
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	return out
}

// BenchmarkRichFloodHeap measures the heap of the test process (the
// server and its in-memory client) while one call returns a box's ~46 MiB
// of HTML displays, the case that grew a server from 13 to 355 MiB, and
// 5 MiB, which fits in the longest answer to an exec but not in MaxRich. It
// reports the peak heap in use above the baseline as peak-MiB, and the
// size of the result the client got as result-MiB.
//
//	go test ./internal/mcpserver -run '^$' -bench RichFloodHeap -benchtime 3x
func BenchmarkRichFloodHeap(b *testing.B) {
	for _, c := range []struct {
		name string
		size int
	}{{"46MiB", 46 << 20}, {"5MiB", 5 << 20}} {
		b.Run(c.name, func(b *testing.B) { richFloodHeap(b, c.size) })
	}
}

func richFloodHeap(b *testing.B, floodBytes int) {
	body := htmlFlood(floodBytes)
	mgr := session.NewManager(session.Options{Backend: floodBackend{body}, DefaultTimeout: time.Minute})
	b.Cleanup(mgr.Close)
	srv := mcpserver.New(mcpserver.Options{Manager: mgr, Backend: "flood"})
	cs := dial(b, srv)
	var peak, size atomic.Uint64
	var once sync.Once
	for b.Loop() {
		b.StopTimer()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		base := ms.HeapInuse
		stop := make(chan struct{})
		peakc := peakHeap(stop)
		b.StartTimer()
		res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "run_python", Arguments: map[string]any{"code": "flood()"}})
		b.StopTimer()
		close(stop)
		p := <-peakc
		var raw []byte
		if err != nil {
			once.Do(func() { b.Logf("the client got no result: %v", err) })
		} else {
			raw, _ = json.Marshal(res)
			once.Do(func() { b.Logf("result: %d bytes, isError=%v, text %.300q", len(raw), res.IsError, text(res)) })
		}
		peak.Store(max(peak.Load(), p-min(p, base)))
		size.Store(uint64(len(raw)))
		res = nil
		b.StartTimer()
	}
	b.ReportMetric(float64(peak.Load())/(1<<20), "peak-MiB")
	b.ReportMetric(float64(size.Load())/(1<<20), "result-MiB")
}
