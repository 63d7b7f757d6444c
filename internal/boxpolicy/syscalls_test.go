package boxpolicy

import (
	"slices"
	"testing"

	"github.com/elastic/go-seccomp-bpf/arch"
)

// TestSyscallPolicyTable checks the table both loaders read: every name is
// a syscall of x86_64, no rule is unreachable, nothing denied is allowed,
// and each argument check is one runsc and the jail read alike.
func TestSyscallPolicyTable(t *testing.T) {
	final, allowed := checkPolicyTable(t, SyscallPolicy)
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

// TestDenoSyscallPolicyTable checks the wasm backend's Deno filter as the
// box policy is checked, and that it is narrower: no socket but a unix
// socketpair, no namespace, nothing the box policy refuses.
func TestDenoSyscallPolicyTable(t *testing.T) {
	final, allowed := checkPolicyTable(t, DenoSyscallPolicy)
	for _, n := range slices.Concat(DeniedSyscalls, DenoAbsentSyscalls) {
		if allowed[n] {
			t.Errorf("%q is refused and allowed", n)
		}
	}
	for _, n := range []string{"clone", "socket", "socketpair", "prctl"} {
		if i, ok := final[n]; !ok || DenoSyscallPolicy[i].Action != Deny {
			t.Errorf("%q: no final refusal", n)
		}
	}
	for _, c := range []struct {
		name string
		args []uint64
		want SyscallAction
	}{
		{"socket", []uint64{AFInet}, Deny},
		{"socket", []uint64{AFUnix}, Deny},
		{"socket", []uint64{AFNetlink}, Deny},
		{"socketpair", []uint64{AFUnix}, Allow},
		{"socketpair", []uint64{AFInet}, Deny},
		{"clone", []uint64{CloneNewUser}, Deny},
		{"clone", []uint64{0x3d0f00}, Allow}, // a thread
		{"mprotect", nil, Allow},             // V8's JIT
		{"ptrace", nil, Deny},
		{"unshare", nil, Deny},
		{"clone3", nil, Absent},
		{"connect", nil, Absent},
		{"bind", nil, Absent},
	} {
		got, ok := PolicyAction(DenoSyscallPolicy, c.name, c.args)
		if !ok {
			got = Absent
		}
		if got != c.want {
			t.Errorf("%s %#x: %v, want %v", c.name, c.args, got, c.want)
		}
	}
	for _, r := range DenoSyscallPolicy {
		for _, n := range r.Names {
			if r.Action != Allow || len(r.Args) > 0 {
				continue
			}
			if a, ok := PolicyAction(SyscallPolicy, n, nil); !ok || a != Allow {
				t.Errorf("deno may call %q, which the box policy refuses", n)
			}
		}
	}
}

// checkPolicyTable checks what every policy must hold: every name is a
// syscall of x86_64, no rule is unreachable, and each argument check is
// one runsc and the jail read alike. It returns, for each name, the rule
// that decides all its calls, and the names some rule allows.
func checkPolicyTable(t *testing.T, policy []SyscallRule) (final map[string]int, allowed map[string]bool) {
	t.Helper()
	amd64 := arch.X86_64.SyscallNames
	final = map[string]int{} // name → the rule that decides all its calls
	allowed = map[string]bool{}
	for i, r := range policy {
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
	return final, allowed
}
