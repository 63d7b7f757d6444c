package kubernetes

import (
	"encoding/json"
	"fmt"
	"slices"
	"syscall"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/sandbox"
)

// SeccompProfile is kiln's syscall policy (sandbox.SyscallPolicy, the
// jail's and gVisor's too) as a seccomp profile in the OCI/containerd JSON
// format that a Pod names as Localhost: rule for rule, first match wins,
// explicit refusals fail with EPERM, and everything the policy does not name
// fails with ENOSYS, as under the jail; a refusal that follows argument
// rules which allow (clone with a namespace flag, a socket family that is
// not allowed, prctl options) fails with ENOSYS too, since libseccomp has
// no first-match order to express it. Argument checks are masked compares
// (SCMP_CMP_MASKED_EQ takes the mask in value and the expected bits in
// valueTwo). Only the native architecture is listed, so an i386 (int 0x80)
// or x32-numbered call takes the default action and fails with ENOSYS.
//
// The profile must be on every node, under the kubelet's seccomp directory
// (/var/lib/kubelet/seccomp), at the path the backend is given
// (--k8s-seccomp-profile); `kiln k8s seccomp-profile` prints it.
//
// Under runc the runtime installs the filter before the container's first
// process, kiln-agent, starts, and everything the agent starts inherits it:
// code runs under exactly this policy (the agent adds no filter of its own
// on Kubernetes). The agent needs nothing the policy refuses: it runs as
// root and starts code as the box's uid through setgroups, setgid and
// setuid, takes code's file ids with setfsuid and setfsgid, empties its
// inheritable capabilities (capset), makes itself non-dumpable (prctl
// PR_SET_DUMPABLE) and sets rlimits, all allowed to code as well (code has
// no capability that would make them matter). Under gVisor runsc applies
// the profile inside its kernel.
func SeccompProfile() []byte {
	eperm := uint(syscall.EPERM)
	enosys := uint(syscall.ENOSYS)
	var sys []specs.LinuxSyscall
	conditional := map[string]bool{} // names with an argument rule so far
	for _, r := range sandbox.SyscallPolicy {
		names := r.Names
		if len(r.Args) > 0 {
			for _, n := range names {
				conditional[n] = true
			}
		} else if r.Action != sandbox.Allow {
			// libseccomp (runc) does not take the first rule that
			// matches: an unconditional rule of a syscall overrides its
			// argument rules. A refusal after argument rules that allow
			// is left to the default action instead (ENOSYS, not
			// EPERM: refused either way).
			names = slices.DeleteFunc(slices.Clone(names), func(n string) bool { return conditional[n] })
			if len(names) == 0 {
				continue
			}
		}
		s := specs.LinuxSyscall{Names: names}
		switch r.Action {
		case sandbox.Allow:
			s.Action = specs.ActAllow
		case sandbox.Deny:
			s.Action, s.ErrnoRet = specs.ActErrno, &eperm
		default:
			s.Action, s.ErrnoRet = specs.ActErrno, &enosys
		}
		for _, c := range r.Args {
			s.Args = append(s.Args, specs.LinuxSeccompArg{Index: c.Index, Value: c.Mask, ValueTwo: c.Value, Op: specs.OpMaskedEqual})
		}
		sys = append(sys, s)
	}
	p := specs.LinuxSeccomp{
		DefaultAction:   specs.ActErrno,
		DefaultErrnoRet: &enosys,
		Architectures:   []specs.Arch{nativeArch()},
		Syscalls:        sys,
	}
	b, err := json.MarshalIndent(&p, "", "  ")
	if err != nil {
		panic(fmt.Sprintf("encoding seccomp profile: %v", err)) // plain data; cannot fail
	}
	return append(b, '\n')
}
