package bench

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestParseStatCPU(t *testing.T) {
	// A comm with a space and a parenthesis, as a process may name itself.
	line := "4242 (containerd-shim) x) S 1 4242 4242 0 -1 4194560 1 0 0 0 250 130 0 0 20 0 12 0 987654 0 0"
	comm, cpu, start, err := parseStatCPU([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if comm != "containerd-shim) x" || cpu != 3800*time.Millisecond || start != 987654 {
		t.Errorf("got %q %v %d", comm, cpu, start)
	}
	for _, bad := range []string{"", "1 (x", "1 (x) S 1 2", "1 (x) S 1 2 3 4 5 6 7 8 9 10 a b 0 0 0 0 0 0 0"} {
		if _, _, _, err := parseStatCPU([]byte(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// TestSamplerCountsShortLivedProcesses: a process born and gone inside the
// window (as a Pod's shim is, per box) is counted.
func TestSamplerCountsShortLivedProcesses(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("needs /proc")
	}
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("needs bash")
	}
	// The command name is the executable's file name: a link names it.
	burn := filepath.Join(t.TempDir(), "kiln-burn")
	if err := os.Symlink(bash, burn); err != nil {
		t.Fatal(err)
	}
	s := startProcSampler([]component{{"burner", named("kiln-burn")}})
	start := selfChildrenCPU()
	cmd := exec.Command(burn, "-c", `i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done`)
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	spent := selfChildrenCPU() - start
	got := s.stop()["burner"]
	// It may lose its last sample period; clock ticks round it down.
	if got < spent-samplePeriod-2*clockTick || got > spent+clockTick {
		t.Errorf("a process that spent %v of CPU counted %v", spent, got)
	}
	t.Logf("spent %v, counted %v", spent, got)
}

func TestPairJail(t *testing.T) {
	r := &runner{rep: &Report{}}
	for _, k := range []string{"spawn", "session-call", "percall", "k8s-create-hit", "jail:percall", "jail:session-call", "jail:cpu-idle"} {
		r.add(Measurement{Key: k})
	}
	r.pairJail()
	var got []string
	for _, m := range r.rep.Measurements {
		got = append(got, m.Key)
	}
	want := []string{"spawn", "session-call", "jail:session-call", "percall", "jail:percall", "k8s-create-hit", "jail:cpu-idle"}
	if d := cmp.Diff(want, got); d != "" {
		t.Error(d)
	}
}

func selfChildrenCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
