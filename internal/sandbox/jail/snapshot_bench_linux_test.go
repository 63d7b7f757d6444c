package jail_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// BenchmarkFork measures a fork of a numpy+pandas session holding a
// 10 MiB DataFrame on the jail: a state-level snapshot of the source
// (snapshot-ms, snapshot-bytes) and loading it into a fresh box
// (load-ms), as fork_session does them. Making the fresh box (create-ms)
// is the pool's work ahead of demand, so it is reported apart.
//
//	go test -run '^$' -bench BenchmarkFork -benchtime 5x ./internal/sandbox/jail/
func BenchmarkFork(b *testing.B) {
	be := newBackend(b)
	defer be.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	spec := sandbox.Spec{ID: "bench-src", Preload: []string{"numpy", "pandas"}}
	src, err := be.Create(ctx, spec)
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	res, err := src.RunPython(ctx, "import numpy as np, pandas as pd\ndf = pd.DataFrame(np.random.rand(163840, 8))\nprint(df.memory_usage(deep=True).sum())", sandbox.ExecOptions{})
	if err != nil || res.Error != nil {
		b.Fatalf("%v %+v", err, res)
	}
	b.Logf("DataFrame: %s bytes", res.Stdout.Text)
	var snapTook, createTook, loadTook time.Duration
	var bytes int64
	b.ResetTimer()
	for i := range b.N {
		dir := filepath.Join(b.TempDir(), "snap")
		os.Mkdir(dir, 0o700)
		start := time.Now()
		info, err := src.(sandbox.Snapshotter).Snapshot(ctx, dir)
		if err != nil {
			b.Fatal(err)
		}
		mid := time.Now()
		spec.ID = "bench-fork"
		box, err := be.Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		created := time.Now()
		if _, err := sandbox.LoadInto(ctx, box, dir, "jail"); err != nil {
			b.Fatal(err)
		}
		end := time.Now()
		snapTook += mid.Sub(start)
		createTook += created.Sub(mid)
		loadTook += end.Sub(created)
		bytes = info.Bytes
		b.StopTimer()
		if r, err := box.RunPython(ctx, "print(df.shape)", sandbox.ExecOptions{}); err != nil || r.Stdout.Text != "(163840, 8)\n" {
			b.Fatalf("fork %d: %v %+v", i, err, r)
		}
		box.Close()
		b.StartTimer()
	}
	n := float64(b.N)
	b.ReportMetric(float64(snapTook.Milliseconds())/n, "snapshot-ms")
	b.ReportMetric(float64(createTook.Milliseconds())/n, "create-ms")
	b.ReportMetric(float64(loadTook.Milliseconds())/n, "load-ms")
	b.ReportMetric(float64(bytes), "snapshot-bytes")
}
