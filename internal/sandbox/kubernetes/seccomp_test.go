package kubernetes

import (
	"encoding/json"
	"slices"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox/gvisor"
)

// TestSeccompProfileIsGVisors checks that a Pod's profile and a gVisor
// box's seccomp section are one policy: each, read in order as runsc reads
// them, and the Pod's also read as a set as libseccomp reads it (runc,
// crun), decides every probe (every call the policy names and two it does
// not, with arguments that pass and fail each check) as the policy does,
// with the same answer for absent calls (ENOSYS). The one difference
// allowed is the Pod's: a refusal after argument rules (clone with a
// namespace flag, other socket families, prctl options), which the
// default action gives for libseccomp, fails with ENOSYS rather than
// EPERM.
func TestSeccompProfileIsGVisors(t *testing.T) {
	var pod specs.LinuxSeccomp
	if err := json.Unmarshal(SeccompProfile(), &pod); err != nil {
		t.Fatal(err)
	}
	box := gvisor.Seccomp()
	if !slices.Equal(pod.Architectures, box.Architectures) || pod.DefaultAction != box.DefaultAction || pod.DefaultAction != specs.ActTrace {
		t.Errorf("architectures %v, %v; default %s, %s: want one native architecture and a trace (ENOSYS) both", pod.Architectures, box.Architectures, pod.DefaultAction, box.DefaultAction)
	}
	checked := map[string]bool{} // calls with argument rules
	for _, r := range boxpolicy.SyscallPolicy {
		for _, n := range r.Names {
			checked[n] = checked[n] || len(r.Args) > 0
		}
	}
	var fallbacks int
	for _, p := range seccompProbes() {
		want, named := boxpolicy.PolicyAction(boxpolicy.SyscallPolicy, p.name, p.args)
		g, k, l := ociDecide(box, p.name, p.args), ociDecide(&pod, p.name, p.args), libseccompDecide(&pod, p.name, p.args)
		var w ociOutcome
		switch {
		case !named || want == boxpolicy.Absent:
			w = "ENOSYS"
		case want == boxpolicy.Allow:
			w = "allow"
		default:
			w = "EPERM"
		}
		if g != w {
			t.Errorf("gVisor: %s%#x: %s, want %s", p.name, p.args, g, w)
		}
		for how, got := range map[string]ociOutcome{"runsc": k, "libseccomp": l} {
			if got != w && (w != "EPERM" || got != "ENOSYS" || !checked[p.name]) {
				t.Errorf("Pod, read by %s: %s%#x: %s, want %s", how, p.name, p.args, got, w)
			}
		}
		if k != w {
			fallbacks++
		}
	}
	if fallbacks == 0 {
		t.Error("no refusal after argument rules was probed")
	}
}

// libseccompDecide reads sc as libseccomp does, as a set: the rules of the
// call whose masked compares all hold decide, and they must agree; a rule
// without checks beside rules with them would override them, and rules
// that match one call with different actions depend on libseccomp's
// internals, so either is "overlap". No rule: the default.
func libseccompDecide(sc *specs.LinuxSeccomp, name string, args []uint64) ociOutcome {
	var plain, checked bool
	var got []ociOutcome
	for _, r := range sc.Syscalls {
		if !slices.Contains(r.Names, name) {
			continue
		}
		plain, checked = plain || len(r.Args) == 0, checked || len(r.Args) > 0
		one := &specs.LinuxSeccomp{DefaultAction: "none", Syscalls: []specs.LinuxSyscall{r}}
		if o := ociDecide(one, name, args); o != "none" {
			got = append(got, o)
		}
	}
	switch {
	case plain && checked:
		return "overlap"
	case len(got) == 0:
		return ociDecide(&specs.LinuxSeccomp{DefaultAction: sc.DefaultAction, DefaultErrnoRet: sc.DefaultErrnoRet}, name, args)
	}
	for _, o := range got[1:] {
		if o != got[0] {
			return "overlap"
		}
	}
	return got[0]
}

type ociOutcome string

// ociDecide reads sc as runsc does: the first rule that names the call and
// whose masked compares all hold decides; then the default.
func ociDecide(sc *specs.LinuxSeccomp, name string, args []uint64) ociOutcome {
	act, errno := sc.DefaultAction, sc.DefaultErrnoRet
	for _, r := range sc.Syscalls {
		fails := func(a specs.LinuxSeccompArg) bool {
			return a.Op != specs.OpMaskedEqual || args[a.Index]&a.Value != a.ValueTwo
		}
		if !slices.Contains(r.Names, name) || slices.ContainsFunc(r.Args, fails) {
			continue
		}
		act, errno = r.Action, r.ErrnoRet
		break
	}
	switch {
	case act == specs.ActAllow:
		return "allow"
	case act == specs.ActTrace:
		return "ENOSYS" // no tracer
	case act == specs.ActErrno && errno != nil && *errno == uint(syscall.EPERM):
		return "EPERM"
	}
	return ociOutcome(string(act))
}

type seccompProbe struct {
	name string
	args []uint64
}

// seccompProbes are every call the policy names, and two it does not,
// with no arguments set, with every rule's checks holding, and with each
// check of a rule failing in turn (in the checked bits or, where the
// check reads the low half only, in the high half).
func seccompProbes() []seccompProbe {
	var out []seccompProbe
	seen := map[string]bool{}
	add := func(name string, args []uint64) {
		out = append(out, seccompProbe{name, slices.Clone(args)})
	}
	for _, r := range boxpolicy.SyscallPolicy {
		for _, n := range r.Names {
			if !seen[n] {
				seen[n] = true
				add(n, make([]uint64, 6))
			}
			if len(r.Args) == 0 {
				continue
			}
			holds := make([]uint64, 6)
			for _, c := range r.Args {
				holds[c.Index] = c.Value
			}
			add(n, holds)
			for _, c := range r.Args {
				a := slices.Clone(holds)
				a[c.Index] ^= c.Mask & -c.Mask // its lowest checked bit
				add(n, a)
				a[c.Index] = c.Value | ^c.Mask
				add(n, a)
			}
		}
	}
	for _, n := range []string{"io_setup", "uselib"} {
		add(n, make([]uint64, 6))
	}
	return out
}
