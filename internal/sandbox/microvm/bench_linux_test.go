package microvm_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"kiln/internal/egress"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/microvm"
)

// Benchmarks of the microVM backend. Every figure is reported with the
// accelerator in its name (here: tcg), because TCG and KVM differ by an
// order of magnitude. Run with:
//
//	KILN_IMAGE_TEST=1 go test -run '^$' -bench . -benchtime 5x ./internal/sandbox/microvm/

var benchSpec = sandbox.Spec{Preload: []string{"numpy", "pandas"}}

// BenchmarkBaselinePythonSpawn is the yardstick: a bare python3 process on
// the host, no isolation at all.
func BenchmarkBaselinePythonSpawn(b *testing.B) {
	py := "/usr/bin/python3" // not a version manager's shim, which adds its own start-up
	if _, err := os.Stat(py); err != nil {
		if py, err = exec.LookPath("python3"); err != nil {
			b.Skip("no python3 on the host")
		}
	}
	for b.Loop() {
		out, err := exec.Command(py, "-c", "print(2+2)").Output()
		if err != nil || string(out) != "4\n" {
			b.Fatalf("python3: %q %v", out, err)
		}
	}
}

func benchFirstAnswer(b *testing.B, be *microvm.Backend) {
	ctx := context.Background()
	// The template is made outside the timed loop.
	sb, err := be.Create(ctx, benchSpec)
	if err != nil {
		b.Fatal(err)
	}
	sb.Close()
	b.ResetTimer()
	for b.Loop() {
		sb, err := be.Create(ctx, benchSpec)
		if err != nil {
			b.Fatal(err)
		}
		res, err := sb.RunPython(ctx, "print(2+2)", sandbox.ExecOptions{})
		if err != nil || res.Stdout.Text != "4\n" {
			b.Fatalf("first answer: %+v %v", res, err)
		}
		sb.Close()
	}
}

// BenchmarkRestoreToFirstAnswer: restore a clone of the warm template, run
// print(2+2), destroy it.
func BenchmarkRestoreToFirstAnswer(b *testing.B) {
	be := newBackend(b, microvm.Options{})
	b.Run("accel="+be.Accel(), func(b *testing.B) { benchFirstAnswer(b, be) })
}

// BenchmarkColdBootToFirstAnswer: boot a VM, import numpy and pandas, run
// print(2+2), destroy it.
func BenchmarkColdBootToFirstAnswer(b *testing.B) {
	be := newBackend(b, microvm.Options{ColdBoot: true})
	b.Run("accel="+be.Accel(), func(b *testing.B) { benchFirstAnswer(b, be) })
}

// BenchmarkRoundTrip: one call in a live box (what a session call costs).
func BenchmarkRoundTrip(b *testing.B) {
	be := newBackend(b, microvm.Options{})
	b.Run("accel="+be.Accel(), func(b *testing.B) {
		ctx := context.Background()
		sb, err := be.Create(ctx, benchSpec)
		if err != nil {
			b.Fatal(err)
		}
		defer sb.Close()
		for b.Loop() {
			res, err := sb.RunPython(ctx, "2+2", sandbox.ExecOptions{})
			if err != nil || res.Result == nil {
				b.Fatalf("round trip: %+v %v", res, err)
			}
		}
	})
}

// BenchmarkPSSPerClone restores clones, has each import pandas and run a
// cell, and reports the mean proportional set size of their QEMU
// processes: what a clone costs the host beyond the shared template.
func BenchmarkPSSPerClone(b *testing.B) {
	be := newBackend(b, microvm.Options{})
	b.Run("accel="+be.Accel(), func(b *testing.B) {
		const clones = 4
		ctx := context.Background()
		for b.Loop() {
			var boxes []sandbox.Sandbox
			for range clones {
				sb, err := be.Create(ctx, benchSpec)
				if err != nil {
					b.Fatal(err)
				}
				boxes = append(boxes, sb)
				if _, err := sb.RunPython(ctx, "import pandas as pd; pd.DataFrame({'a': [1, 2]}).sum()", sandbox.ExecOptions{}); err != nil {
					b.Fatal(err)
				}
			}
			var pss, rss int64
			pids := microvm.QEMUPIDs(be)
			for _, pid := range pids {
				p, r := smapsRollup(b, pid)
				pss += p
				rss += r
			}
			b.ReportMetric(float64(pss)/float64(len(pids))/1024, "PSS-MiB/clone")
			b.ReportMetric(float64(rss)/float64(len(pids))/1024, "RSS-MiB/clone")
			for _, sb := range boxes {
				sb.Close()
			}
		}
	})
}

// smapsRollup returns a process's Pss and Rss in KiB.
func smapsRollup(b *testing.B, pid int) (pss, rss int64) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(fs[1], 10, 64)
		switch fs[0] {
		case "Pss:":
			pss = n
		case "Rss:":
			rss = n
		}
	}
	return pss, rss
}

// BenchmarkCreateEgress measures Create and the first answer of a clone
// with and without an egress policy: the network's cost at creation (a
// namespace, a veth, a bridge and a tap, and the address in the seed).
func BenchmarkCreateEgress(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("skipping: the egress gateway and a VM's tap need root")
	}
	gw, err := egress.NewGateway(egress.Options{})
	if err != nil {
		b.Skipf("skipping: egress gateway unavailable: %v", err)
	}
	defer gw.Close()
	for _, tc := range []struct {
		name   string
		policy egress.Policy
	}{{"none", egress.Policy{}}, {"policy", egress.MustParsePolicy("pypi.org", "*.pythonhosted.org")}} {
		b.Run(tc.name+"-tcg", func(b *testing.B) {
			benchFirstAnswer(b, newBackend(b, microvm.Options{Egress: gw, Policy: tc.policy}))
		})
	}
}
