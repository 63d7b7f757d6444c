package sandbox

import (
	"slices"
	"testing"

	"github.com/elastic/go-seccomp-bpf/arch"
)

// TestSyscallPolicyTable checks the table both loaders read: every name is
// a syscall of x86_64, no rule is unreachable, nothing denied is allowed,
// and each argument check is one runsc and the jail read alike.
func TestSyscallPolicyTable(t *testing.T) {
	amd64 := arch.X86_64.SyscallNames
	final := map[string]int{} // name → the rule that decides all its calls
	allowed := map[string]bool{}
	for i, r := range SyscallPolicy {
		if len(r.Names) == 0 {
			t.Errorf("rule %d names no syscall", i)
		}
		seen := map[uint]bool{}
		for _, c := range r.Args {
			if c.Index > 5 || c.Mask == 0 || c.Value&^c.Mask != 0 || seen[c.Index] {
				t.Errorf("rule %d %v: argument check %+v", i, r.Names, c)
			}
			seen[c.Index] = true
		}
		for _, n := range r.Names {
			if _, ok := amd64[n]; !ok {
				t.Errorf("rule %d: %q is not a syscall on x86_64", i, n)
			}
			if j, ok := final[n]; ok {
				t.Errorf("rule %d: %q is already decided by rule %d", i, n, j)
			}
			if len(r.Args) == 0 {
				final[n] = i
			}
			if r.Action == Allow {
				allowed[n] = true
			}
		}
	}
	for _, n := range slices.Concat(DeniedSyscalls, AbsentSyscalls) {
		if allowed[n] {
			t.Errorf("%q is refused and allowed", n)
		}
		if _, ok := final[n]; !ok {
			t.Errorf("%q has no rule of its own", n)
		}
	}
	// The calls with argument filters end in a refusal of their own, so a
	// value the filter does not know is refused, with EPERM.
	for _, n := range []string{"clone", "socket", "socketpair", "prctl", "personality"} {
		if i, ok := final[n]; !ok || SyscallPolicy[i].Action != Deny {
			t.Errorf("%q: no final refusal", n)
		}
	}
	for _, n := range []string{"read", "write", "execve", "exit_group", "futex", "mmap", "rt_sigreturn", "ioctl", "clone", "socket"} {
		if !allowed[n] {
			t.Errorf("%q is not allowed", n)
		}
	}
	for _, n := range []string{"unshare", "setns", "mount", "ptrace", "bpf", "io_uring_setup", "userfaultfd", "perf_event_open", "keyctl", "pidfd_getfd", "process_vm_readv", "kexec_load", "init_module"} {
		if allowed[n] || !slices.Contains(DeniedSyscalls, n) {
			t.Errorf("%q is not denied", n)
		}
	}
	if !slices.Contains(AbsentSyscalls, "clone3") {
		t.Errorf("clone3 is not absent: libc would not fall back to clone")
	}
}
