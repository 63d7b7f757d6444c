package jail

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox/sandboxtest"
)

// BenchmarkZygoteTemplateStart measures what one template replacement
// costs: the CPU time of the template (its init, python and the preload
// imports) until it is ready, and the wall time.
//
//	go test -run X -bench ZygoteTemplateStart -benchtime 5x ./internal/sandbox/jail/
func BenchmarkZygoteTemplateStart(b *testing.B) {
	if os.Getuid() != 0 {
		b.Skip("the zygote needs root")
	}
	be, err := New(Options{Agent: sandboxtest.BuildAgent(b), Zygote: true})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	if be.zy == nil {
		b.Skip("the zygote is off on this host")
	}
	tick := 10 * time.Millisecond // USER_HZ is 100 on Linux
	var cpu, wall time.Duration
	for b.Loop() {
		start := time.Now()
		t, err := be.zy.start(context.Background(), "numpy,pandas,matplotlib")
		if err != nil {
			b.Fatal(err)
		}
		wall += time.Since(start)
		stat, err := os.ReadFile("/proc/" + strconv.Itoa(t.cmd.Process.Pid) + "/stat")
		if err != nil {
			b.Fatal(err)
		}
		f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+2:]))
		for _, i := range []int{11, 12, 13, 14} { // utime stime cutime cstime
			n, _ := strconv.Atoi(f[i])
			cpu += time.Duration(n) * tick
		}
		t.stop()
	}
	b.ReportMetric(float64(cpu.Milliseconds())/float64(b.N), "cpu-ms/start")
	b.ReportMetric(float64(wall.Milliseconds())/float64(b.N), "wall-ms/start")
}
