package kubernetes

import (
	"encoding/json"
	"fmt"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox/boxkit"
)

// SeccompProfile is kiln's syscall policy (boxpolicy.SyscallPolicy, the
// jail's and gVisor's too) as a seccomp profile in the OCI/containerd JSON
// format that a Pod names as Localhost, rendered by boxkit.OCISeccomp as
// gVisor's is: explicit refusals fail with EPERM, and what the policy
// makes absent (clone3) and everything it does not name fail with ENOSYS,
// under runc, crun and runsc alike. It is rendered for libseccomp's
// reading (boxkit.LibseccompMatch), which has no first-match order: a
// refusal that follows argument rules which allow (clone with a namespace
// flag, a socket family that is not allowed, prctl options) fails with
// ENOSYS rather than EPERM.
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
	b, err := json.MarshalIndent(boxkit.OCISeccomp(boxpolicy.SyscallPolicy, boxkit.LibseccompMatch), "", "  ")
	if err != nil {
		panic(fmt.Sprintf("encoding seccomp profile: %v", err)) // plain data; cannot fail
	}
	return append(b, '\n')
}
