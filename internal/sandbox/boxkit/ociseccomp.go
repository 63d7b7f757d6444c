package boxkit

import (
	"fmt"
	"runtime"
	"slices"
	"syscall"

	"kiln/internal/boxpolicy"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// OCI seccomp: a syscall policy (boxpolicy.SyscallPolicy) as the seccomp
// section of an OCI runtime spec, written here once for every runtime kiln
// hands one to: runsc for the gVisor backend (--oci-seccomp), and runc,
// crun or runsc on the nodes of the Kubernetes backend (a Localhost
// profile). It is rendered here rather than in boxpolicy because both
// readers need runtime-spec's own types (gVisor embeds the section in its
// specs.Spec), and a standard-library copy of that schema would be one
// more spelling of it to drift; the guest never reads OCI.
//
// ENOSYS, for what the policy makes absent (clone3) and for every call it
// does not name, is SCMP_ACT_TRACE, by default and in rules: with no
// tracer the kernel (and gVisor's) fails a traced call with ENOSYS, and
// there is none, since ptrace is denied in the box. SCMP_ACT_ERRNO with
// errnoRet ENOSYS would say the same to runc and crun, but runsc answers
// every SCMP_ACT_ERRNO with EPERM whatever errnoRet says, and EPERM from
// clone3 breaks threads (libc falls back to clone(2) only on ENOSYS).
// Explicit refusals are SCMP_ACT_ERRNO with EPERM. Argument checks are
// masked compares (SCMP_CMP_MASKED_EQ takes the mask in value and the
// expected bits in valueTwo). Only the native architecture is listed:
// runc and crun then give an i386 (int 0x80) or x32-numbered call the
// default action (ENOSYS), and runsc ignores the list and kills a thread
// whose call claims another architecture.

// SeccompMatch is how a runtime reads the rules of a seccomp section.
type SeccompMatch int

const (
	// FirstMatch: the first rule that names a call and whose argument
	// checks hold decides (runsc), as boxpolicy.PolicyAction reads the
	// policy. Every rule is rendered as it is.
	FirstMatch SeccompMatch = iota
	// LibseccompMatch: the rules are a set (runc and crun, through
	// libseccomp), in which a rule without argument checks overrides a
	// call's rules with them, whatever their order. So a call's refusal
	// without checks that follows rules with them (clone with a
	// namespace flag, the socket families not allowed, prctl options) is
	// left out: the call takes the default action, ENOSYS rather than
	// EPERM, refused either way. A call's allowance without checks that
	// follows refusals with them (ioctl's refused commands, then every
	// other command) is rendered as the rules that match what none of
	// those does: one masked compare for each branch off their values
	// (the prefixes of the values' bits under the mask), which needs them
	// all to check one argument under one mask; rendering fails (panics)
	// otherwise, as no policy of kiln's does.
	LibseccompMatch
)

// OCISeccomp renders policy for a runtime that reads rules as match says.
func OCISeccomp(policy []boxpolicy.SyscallRule, match SeccompMatch) *specs.LinuxSeccomp {
	if match == LibseccompMatch {
		policy = disjointRules(policy)
	}
	eperm := uint(syscall.EPERM)
	var sys []specs.LinuxSyscall
	for _, r := range policy {
		s := specs.LinuxSyscall{Names: r.Names}
		switch r.Action {
		case boxpolicy.Allow:
			s.Action = specs.ActAllow
		case boxpolicy.Deny:
			s.Action, s.ErrnoRet = specs.ActErrno, &eperm
		default:
			s.Action = specs.ActTrace
		}
		for _, c := range r.Args {
			s.Args = append(s.Args, specs.LinuxSeccompArg{Index: c.Index, Value: c.Mask, ValueTwo: c.Value, Op: specs.OpMaskedEqual})
		}
		sys = append(sys, s)
	}
	return &specs.LinuxSeccomp{
		DefaultAction: specs.ActTrace,
		Architectures: []specs.Arch{NativeSeccompArch()},
		Syscalls:      sys,
	}
}

// disjointRules is policy with no rule that overrides another under
// libseccomp (LibseccompMatch): a call's refusal without checks after
// rules with them goes, an allowance becomes the rules for what none of
// those match; rules after a call's rule without checks, which first
// match never reaches, go.
func disjointRules(policy []boxpolicy.SyscallRule) []boxpolicy.SyscallRule {
	var out []boxpolicy.SyscallRule
	checked := map[string][]boxpolicy.ArgCheck{} // a call's argument rules so far
	split := map[string]bool{}                   // a call whose rules cannot be complemented
	done := map[string]bool{}                    // a call with a rule without checks
	for _, r := range policy {
		names := slices.DeleteFunc(slices.Clone(r.Names), func(n string) bool { return done[n] })
		if len(names) == 0 {
			continue
		}
		if len(r.Args) > 0 {
			for _, n := range names {
				if len(r.Args) == 1 && (len(checked[n]) == 0 || checked[n][0].Index == r.Args[0].Index && checked[n][0].Mask == r.Args[0].Mask) {
					checked[n] = append(checked[n], r.Args[0])
				} else {
					split[n] = true
				}
			}
			out = append(out, boxpolicy.SyscallRule{Names: names, Action: r.Action, Args: r.Args})
			continue
		}
		var plain []string
		for _, n := range names {
			done[n] = true
			switch {
			case len(checked[n]) == 0 && !split[n]:
				plain = append(plain, n)
			case r.Action != boxpolicy.Allow:
				// The default action refuses it.
			case split[n]:
				panic(fmt.Sprintf("seccomp policy: %s is allowed after argument rules that do not all check one argument under one mask", n))
			default:
				c := checked[n][0]
				var values []uint64
				for _, v := range checked[n] {
					values = append(values, v.Value)
				}
				for _, m := range complement(c.Mask, values) {
					out = append(out, boxpolicy.SyscallRule{Names: []string{n}, Action: r.Action, Args: []boxpolicy.ArgCheck{{Index: c.Index, Mask: m.Mask, Value: m.Value}}})
				}
			}
		}
		if len(plain) > 0 {
			out = append(out, boxpolicy.SyscallRule{Names: plain, Action: r.Action})
		}
	}
	return out
}

// complement is the masked compares that hold for exactly the arguments
// whose bits under mask equal none of values (each within mask): walking
// the mask's bits from the highest, a compare for each branch that no
// value takes.
func complement(mask uint64, values []uint64) []boxpolicy.ArgCheck {
	var out []boxpolicy.ArgCheck
	var walk func(fixed, prefix uint64, bit int, vs []uint64)
	walk = func(fixed, prefix uint64, bit int, vs []uint64) {
		for bit >= 0 && mask&(1<<bit) == 0 {
			bit--
		}
		if bit < 0 {
			return // every bit fixed: a value's own
		}
		b := uint64(1) << bit
		for _, v := range []uint64{0, b} {
			var take []uint64
			for _, x := range vs {
				if x&b == v {
					take = append(take, x)
				}
			}
			if len(take) == 0 {
				out = append(out, boxpolicy.ArgCheck{Mask: fixed | b, Value: prefix | v})
			} else {
				walk(fixed|b, prefix|v, bit-1, take)
			}
		}
	}
	walk(0, 0, 63, values)
	return out
}

// NativeSeccompArch is the seccomp architecture of kiln's own build, the
// one its boxes' code is native to.
func NativeSeccompArch() specs.Arch {
	if runtime.GOARCH == "arm64" {
		return specs.ArchAARCH64
	}
	return specs.ArchX86_64
}
