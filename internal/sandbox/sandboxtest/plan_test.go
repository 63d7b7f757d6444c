package sandboxtest

import (
	"encoding/json"
	"fmt"
	"math"
	"os/exec"
	"strconv"
	"testing"

	"kiln/internal/boxpolicy"
)

func TestParseMountinfo(t *testing.T) {
	const s = `22 1 0:20 / / ro,nosuid,nodev,relatime - tmpfs tmpfs ro,size=4096k,mode=755
30 22 0:25 / /work rw,nosuid,nodev,relatime - tmpfs tmpfs rw,size=32768k,nr_inodes=65536,mode=755,uid=1000,gid=1000
31 22 0:26 / /my\040dir rw,relatime shared:5 - tmpfs tmpfs rw
32 30 0:27 / /work rw,nosuid - tmpfs tmpfs rw,size=4k
`
	m, err := parseMountinfo(s)
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 4 || m[2].point != "/my dir" || m[2].fstype != "tmpfs" {
		t.Fatalf("parsed %+v", m)
	}
	top, ok := topMount(m, "/work")
	if sz, _ := option(top.super, "size"); !ok || sz != "4k" {
		t.Errorf("the uppermost /work is %+v", top)
	}
	if n, ok := option(m[1].super, "nr_inodes"); !ok || n != "65536" {
		t.Errorf("nr_inodes %q %v", n, ok)
	}
	if _, err := parseMountinfo("1 2 3"); err == nil {
		t.Errorf("a short line parsed")
	}
}

func TestParseLimits(t *testing.T) {
	const s = `Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max core file size        0                    0                    bytes
Max processes             64                   128                  processes
Max open files            1024                 1024                 files
`
	l, err := parseLimits(s)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][2]uint64{"RLIMIT_CPU": {math.MaxUint64, math.MaxUint64}, "RLIMIT_CORE": {0, 0}, "RLIMIT_NPROC": {64, 128}, "RLIMIT_NOFILE": {1024, 1024}}
	if fmt.Sprint(l) != fmt.Sprint(want) {
		t.Errorf("parsed %v, want %v", l, want)
	}
	for _, r := range boxpolicy.New(boxpolicy.Limits{}, 0, 0).Rlimits {
		if _, ok := limitNames[r.Name]; !ok {
			t.Errorf("the plan's %s has no /proc/self/limits name", r.Name)
		}
	}
}

// TestPolicyOutcomes: the probes' expectations come from the policy, and
// between them they try each of its answers.
func TestPolicyOutcomes(t *testing.T) {
	seen := map[string]bool{}
	for _, pr := range planSyscalls {
		seen[policyOutcome(pr.name)] = true
	}
	for _, o := range []string{"ok", "EPERM", "ENOSYS"} {
		if !seen[o] {
			t.Errorf("no probe expects %s", o)
		}
	}
	if policyOutcome("clone3") != "ENOSYS" || policyOutcome("kcmp") != "EPERM" || policyOutcome("getpid") != "ok" {
		t.Errorf("clone3 %s, kcmp %s, getpid %s", policyOutcome("clone3"), policyOutcome("kcmp"), policyOutcome("getpid"))
	}
}

// TestPlanProbeOnHost runs the probe in a plain python3 on the host, so
// that a broken probe shows here rather than only in a box: what it reads
// parses, and its two readings of the rlimits agree.
func TestPlanProbeOnHost(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("needs python3 on the host")
	}
	s := &suite{}
	plan := boxpolicy.New(boxpolicy.Limits{}, 0, 0)
	plan.Tmpfs = []boxpolicy.Tmpfs{{Path: "/tmp"}}
	out, err := exec.Command("python3", "-c", fmt.Sprintf(planProbe, s.probeConfig(plan))).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var got planReading
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if got.Mountinfo.Data == nil || got.Limits.Data == nil || got.Status.Data == nil {
		t.Fatalf("unread: %+v", got)
	}
	if _, err := parseMountinfo(*got.Mountinfo.Data); err != nil {
		t.Error(err)
	}
	limits, err := parseLimits(*got.Limits.Data)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range plan.Rlimits {
		g := got.Getrlimit[r.Name]
		if len(g) != 2 {
			t.Errorf("getrlimit(%s): %v", r.Name, g)
			continue
		}
		l := limits[r.Name]
		for i := range l {
			if strconv.FormatUint(l[i], 10) != strconv.FormatInt(g[i], 10) && !(l[i] == math.MaxUint64 && g[i] == -1) {
				t.Errorf("%s: /proc/self/limits says %v, getrlimit %v", r.Name, l, g)
			}
		}
	}
	if _, ok := statusField(*got.Status.Data, "Seccomp"); !ok {
		t.Errorf("no Seccomp line in /proc/self/status")
	}
	if got.Probes["getpid"] != "ok" || len(got.Probes) != len(planSyscalls) {
		t.Errorf("probes on the host: %v", got.Probes)
	}
	if st := got.Tmpfs["/tmp"]; st.Error != "" || st.Bsize == 0 {
		t.Errorf("stat /tmp: %+v", st)
	}
}

func TestMaskState(t *testing.T) {
	empty, some := "", "keys"
	mounts, err := parseMountinfo(`1 0 0:1 / / ro - tmpfs tmpfs ro
2 1 0:2 / /proc rw,nosuid - proc proc rw
3 2 0:3 /null /proc/kcore rw,nosuid - devtmpfs udev rw
4 2 0:2 /sysrq-trigger /proc/sysrq-trigger ro,nosuid,nodev,noexec - proc proc rw
`)
	if err != nil {
		t.Fatal(err)
	}
	const devnull = 0x103
	for _, c := range []struct {
		p      string
		m      maskReading
		masked bool
	}{
		{"/proc/kcore", maskReading{Mode: 0o20666, Chr: true, Rdev: devnull, Data: &empty}, true},
		{"/proc/kcore", maskReading{Mode: 0o20666, Chr: true, Rdev: 0x105, Data: &empty}, false},
		{"/proc/keys", maskReading{Absent: true}, true},
		{"/proc/keys", maskReading{Mode: 0o100444, Data: &some}, false},
		{"/proc/keys", maskReading{Mode: 0o100444, Data: &empty}, false}, // readable, just empty now
		{"/proc/kcore", maskReading{Mode: 0o100400, Errno: "EACCES"}, false},
		{"/proc/timer_list", maskReading{LstatErrno: "EACCES"}, false},
		{"/proc/sysrq-trigger", maskReading{Mode: 0o100200, Errno: "EACCES"}, true},
		{"/proc/timer_list", maskReading{Mode: 0o100200, Errno: "EACCES"}, false}, // no read-only mount over it
	} {
		if how, masked := maskState(c.p, c.m, mounts, devnull); masked != c.masked {
			t.Errorf("%s %v: masked %v (%s), want %v", c.p, c.m, masked, how, c.masked)
		}
	}
}
