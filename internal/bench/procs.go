package bench

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// The control plane's CPU, by component, counted from /proc. Its
// processes run outside the bench's cgroup (they are the machine's
// daemons), so the machine-wide figure holds them among everything else;
// this splits out what each component spent. A sampler polls /proc, so a
// process that ends inside the window (a Pod's containerd shim, runc) is
// counted up to its last sample: at most samplePeriod of its life is
// missed.

// component is a group of control-plane processes, by their command name
// (/proc/<pid>/comm, at most 15 bytes).
type component struct {
	name  string
	match func(comm string) bool
}

func named(names ...string) func(string) bool {
	return func(c string) bool {
		for _, n := range names {
			if c == n {
				return true
			}
		}
		return false
	}
}

// k8sComponents are the cluster's processes the bench counts. The shims
// and runc are the per-Pod part of the container runtime.
var k8sComponents = []component{
	{"kube-apiserver", named("kube-apiserver")},
	{"etcd", named("etcd")},
	{"kubelet", named("kubelet")},
	{"containerd", named("containerd")},
	{"shims+runc", func(c string) bool {
		return strings.HasPrefix(c, "containerd-shim") || c == "runc" || strings.HasPrefix(c, "runc:")
	}},
	{"scheduler+controllers", named("kube-scheduler", "kube-controller", "kube-router")},
}

// samplePeriod is how often the sampler polls /proc.
const samplePeriod = 50 * time.Millisecond

// parseStatCPU returns the comm and the CPU time (utime + stime) and
// start time of one /proc/<pid>/stat.
func parseStatCPU(b []byte) (comm string, cpu time.Duration, start uint64, err error) {
	s := string(b)
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || end < open {
		return "", 0, 0, fmt.Errorf("malformed stat %q", s)
	}
	comm = s[open+1 : end]
	f := strings.Fields(s[end+1:])
	// f[0] is field 3 (state): utime is field 14, stime 15, starttime 22.
	if len(f) < 20 {
		return "", 0, 0, fmt.Errorf("short stat %q", s)
	}
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	start, err3 := strconv.ParseUint(f[19], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return "", 0, 0, fmt.Errorf("malformed stat %q", s)
	}
	return comm, time.Duration(ut+st) * clockTick, start, nil
}

// componentCPU is what each component spent over a window, by name.
type componentCPU map[string]time.Duration

func (c componentCPU) total() time.Duration {
	var t time.Duration
	for _, d := range c {
		t += d
	}
	return t
}

// describe lists each component's figure per n operations, net of base
// scaled to the same length (base over baseFor, c over over).
func (c componentCPU) describe(n int, base componentCPU, baseFor, over time.Duration) string {
	var parts []string
	for _, k := range k8sComponents {
		d := c[k.name]
		if base != nil && baseFor > 0 {
			d -= time.Duration(float64(base[k.name]) * over.Seconds() / baseFor.Seconds())
		}
		parts = append(parts, fmt.Sprintf("%s %s", k.name, num(ms(d)/float64(n))))
	}
	return strings.Join(parts, ", ")
}
