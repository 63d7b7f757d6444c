package session_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// BenchmarkUnpolledJobs runs 32 background jobs of one principal, each
// writing 4 MiB to stdout and to stderr (kiln's --keep-output), and polls
// none of them: what the server holds for finished, unpolled jobs is
// their results. Metric: retained-MiB, the heap the manager holds once
// they are done (after a GC), over the heap before them.
func BenchmarkUnpolledJobs(b *testing.B) {
	const jobs, stream = 32, 4 << 20
	for range b.N {
		be := sessiontest.New(b, nil)
		mgr := session.NewManager(session.Options{Backend: be, Mode: session.ModePerCall, MaxOutput: stream})
		ctx := context.Background()
		var before runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		var held []*session.Job
		for range jobs {
			j, err := mgr.StartOnce(ctx, "local", session.Shell, "head -c 4194304 /dev/zero | tr '\\0' o; head -c 4194304 /dev/zero | tr '\\0' e >&2", nil, time.Minute)
			if err != nil {
				b.Fatal(err)
			}
			for !j.Done() {
				time.Sleep(5 * time.Millisecond)
			}
			held = append(held, j)
		}
		var after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/(1<<20), "retained-MiB")
		runtime.KeepAlive(held)
		mgr.Close()
	}
}
