package jail_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/sandboxtest"
)

// BenchmarkZygoteBox measures a per-call run on a forked box: create it,
// run print(2+2), destroy it, one after another. cpu-ms/box is the CPU time
// of everything the test process started (server side, template, boxes),
// counted in a cpuacct group of its own where cgroup v1 has that
// hierarchy (the jail moves boxes only in the cpu, memory and pids ones);
// the machine's other work does not count, kernel threads' (network
// namespace teardown) does not either.
//
//	go test -run X -bench ZygoteBox -benchtime 100x ./internal/sandbox/jail/
func BenchmarkZygoteBox(b *testing.B) {
	if os.Getuid() != 0 {
		b.Skip("the zygote needs root")
	}
	usage := cpuacctGroup(b)
	be, err := jail.New(jail.Options{Agent: sandboxtest.BuildAgent(b), Zygote: true})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	ctx := context.Background()
	spec := sandbox.Spec{Preload: []string{"numpy", "pandas", "matplotlib"}}
	run := func(i int) {
		spec.ID = fmt.Sprintf("bench-%d", i)
		box, err := be.Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		res, err := box.RunPython(ctx, "print(2+2)", sandbox.ExecOptions{})
		if err != nil || res.Error != nil {
			b.Fatalf("%v %+v", err, res)
		}
		box.Close()
	}
	run(-1) // the template starts
	time.Sleep(time.Second)
	cpu0 := usage()
	i := 0
	for b.Loop() {
		run(i)
		i++
	}
	if cpu0 >= 0 {
		b.ReportMetric(float64(usage()-cpu0)/1e6/float64(b.N), "cpu-ms/box")
	}
}

// cpuacctGroup moves the test process into a cpuacct group of its own and
// returns a reader of the group's usage in ns (-1 without one).
func cpuacctGroup(b *testing.B) func() int64 {
	parent := "/sys/fs/cgroup/cpuacct"
	if st, err := os.Lstat(parent); err != nil || !st.IsDir() {
		b.Log("no cpuacct hierarchy of its own: CPU time not counted")
		return func() int64 { return -1 }
	}
	dir := filepath.Join(parent, "kiln-jail-bench-"+strconv.Itoa(os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		os.WriteFile(filepath.Join(parent, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0)
		for range 50 {
			if os.Remove(dir) == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	return func() int64 {
		v, err := os.ReadFile(filepath.Join(dir, "cpuacct.usage"))
		if err != nil {
			b.Fatal(err)
		}
		n, _ := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64)
		return n
	}
}
