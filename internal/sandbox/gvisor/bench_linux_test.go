package gvisor

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// Benchmarks (root and runsc needed, as for the tests):
//
//	go test ./internal/sandbox/gvisor -run '^$' -bench . -benchtime 20x
//
// BenchmarkBarePython is the baseline: a host python3 with no sandbox.

func BenchmarkBarePython(b *testing.B) {
	for _, code := range []string{"print(2+2)", "import numpy; print(2+2)"} {
		b.Run(benchName(code), func(b *testing.B) {
			for b.Loop() {
				if out, err := exec.Command("/usr/bin/python3", "-c", code).Output(); err != nil || strings.TrimSpace(string(out)) != "4" {
					b.Fatalf("python3: %q %v", out, err)
				}
			}
		})
	}
}

func benchName(code string) string {
	if strings.Contains(code, "numpy") {
		return "numpy"
	}
	return "plain"
}

var benchPreloads = map[string][]string{"plain": nil, "numpy": {"numpy"}, "sci": {"numpy", "pandas", "matplotlib"}}

// BenchmarkCreate is a per-call box: create, run print(2+2), destroy.
func BenchmarkCreate(b *testing.B) {
	for _, mode := range []string{"cold", "restore"} {
		for _, pre := range []string{"plain", "numpy", "sci"} {
			b.Run(mode+"/"+pre, func(b *testing.B) {
				be := newTestBackend(b, Options{Cold: mode == "cold"})
				ctx := context.Background()
				spec := sandbox.Spec{Preload: benchPreloads[pre]}
				if mode == "restore" {
					if err := be.Warm(ctx, spec); err != nil {
						b.Fatal(err)
					}
				}
				i := 0
				for b.Loop() {
					i++
					spec.ID = fmt.Sprintf("bench-%d", i)
					sb, err := be.Create(ctx, spec)
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
			})
		}
	}
}

// BenchmarkRoundTrip is one call in a live session box.
func BenchmarkRoundTrip(b *testing.B) {
	be := newTestBackend(b, Options{Cold: true})
	sb, err := be.Create(context.Background(), sandbox.Spec{ID: "bench-rt", Preload: []string{"numpy"}})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	for _, code := range []string{"2+2", "numpy.arange(1000).sum()"} {
		b.Run(benchName(code), func(b *testing.B) {
			run(b, sb, "import numpy")
			for b.Loop() {
				run(b, sb, code)
			}
		})
	}
}

// BenchmarkPSS reports the proportional set size of an idle box's host
// processes: those in its cgroup (sandbox, gofer, stubs) and, for "total",
// the waiting runsc run/restore process too.
func BenchmarkPSS(b *testing.B) {
	for _, mode := range []string{"cold", "restore"} {
		b.Run(mode+"/sci", func(b *testing.B) {
			be := newTestBackend(b, Options{Cold: mode == "cold"})
			ctx := context.Background()
			spec := sandbox.Spec{Preload: benchPreloads["sci"]}
			if mode == "restore" {
				if err := be.Warm(ctx, spec); err != nil {
					b.Fatal(err)
				}
			}
			var boxKB, totalKB, n float64
			i := 0
			for b.Loop() {
				i++
				spec.ID = fmt.Sprintf("bench-pss-%d", i)
				sb, err := be.Create(ctx, spec)
				if err != nil {
					b.Fatal(err)
				}
				run(b, sb, "import numpy, pandas, matplotlib.pyplot")
				time.Sleep(200 * time.Millisecond)
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
				n++
				sb.Close()
			}
			b.ReportMetric(boxKB/n/1024, "MiB-PSS-box")
			b.ReportMetric(totalKB/n/1024, "MiB-PSS-total")
		})
	}
}

func boxPids(bx *box) []int {
	return bx.b.cgroups.Group(bx.cgroup).Procs()
}

func pssKB(pid int) int {
	f, err := os.Open(filepath.Join("/proc", strconv.Itoa(pid), "smaps_rollup"))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "Pss:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")))
			return n
		}
	}
	return 0
}
