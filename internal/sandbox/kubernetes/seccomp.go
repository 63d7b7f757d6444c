package kubernetes

import (
	"encoding/json"
	"fmt"
	"syscall"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/sandbox"
)

// SeccompProfile is kiln's syscall policy (sandbox.SyscallPolicy, the
// jail's and gVisor's too) as a seccomp profile in the OCI/containerd JSON
// format that a Pod names as Localhost: rule for rule, first match wins,
// explicit refusals fail with EPERM, and everything the policy does not name
// fails with ENOSYS, as under the jail. Argument checks are masked compares
// (SCMP_CMP_MASKED_EQ takes the mask in value and the expected bits in
// valueTwo). Only the native architecture is listed, so an i386 (int 0x80)
// or x32-numbered call takes the default action and fails with ENOSYS.
//
// The profile must be on every node, under the kubelet's seccomp directory
// (/var/lib/kubelet/seccomp), at the path the backend is given
// (--k8s-seccomp-profile); `kiln k8s seccomp-profile` prints it.
//
// Under runc the filter covers kiln-agent too (it is the container's first
// process); the agent needs nothing the policy refuses, since on Kubernetes
// it runs as the code's own non-root user and changes no ids. Under gVisor
// runsc applies it inside its kernel.
func SeccompProfile() []byte {
	eperm := uint(syscall.EPERM)
	enosys := uint(syscall.ENOSYS)
	var sys []specs.LinuxSyscall
	for _, r := range sandbox.SyscallPolicy {
		s := specs.LinuxSyscall{Names: r.Names}
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
