package session_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"kiln/internal/session"
)

// BenchmarkHibernateResume hibernates a jail session holding numpy,
// pandas and a 10 MiB DataFrame, then resumes it with a call that reads
// the DataFrame. Metrics: hibernate-ms (snapshot, write to disk, destroy
// the box), resume-ms (the resuming call, to its answer), snapshot-bytes.
func BenchmarkHibernateResume(b *testing.B) {
	mgr := session.NewManager(session.Options{
		Backend:   jailBackend(b, false),
		Preload:   []string{"numpy", "pandas"},
		PoolSize:  1,
		Hibernate: session.HibernateOptions{Dir: b.TempDir(), CheckpointEvery: -1},
	})
	b.Cleanup(mgr.Close)
	s, err := mgr.Get("local", "bench")
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	// 1310720 float64 = 10 MiB.
	if out, err := s.RunPython(ctx, "import numpy as np, pandas as pd\ndf = pd.DataFrame({'a': np.random.rand(1310720)})\ndf.memory_usage().sum()", time.Minute); err != nil || out.Error != nil {
		b.Fatalf("%v %+v", err, out)
	}
	var hib, res time.Duration
	var bytes int64
	b.ResetTimer()
	for b.Loop() {
		start := time.Now()
		if !mgr.HibernateNow("local", "bench") {
			b.Fatal("the session was not hibernated")
		}
		hib += time.Since(start)
		for _, si := range mgr.SessionList("local") {
			bytes = si.Bytes
		}
		start = time.Now()
		out, err := s.RunPython(ctx, "len(df)", time.Minute)
		res += time.Since(start)
		if err != nil || out.Result["text/plain"] != "1310720" || !strings.Contains(out.Note, "resumed") {
			b.Fatalf("%v %+v %q", err, out.ExecResult, out.Note)
		}
	}
	b.ReportMetric(float64(hib.Milliseconds())/float64(b.N), "hibernate-ms")
	b.ReportMetric(float64(res.Milliseconds())/float64(b.N), "resume-ms")
	b.ReportMetric(float64(bytes), "snapshot-bytes")
}
