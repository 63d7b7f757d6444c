package boxkit

import (
	"encoding/binary"
	"fmt"
	"testing"

	"kiln/internal/boxpolicy"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
)

// TestSeccompProgram runs the box policy's assembled x86_64 program in a BPF
// interpreter on calls through each entry: the i386 and foreign
// architectures are killed, x32 numbers and unknown calls get ENOSYS, and
// the argument filters hold whatever a caller leaves in the high half of
// an int argument (the kernel reads only the low half). The hostile battery
// runs the same calls in real boxes.
func TestSeccompProgram(t *testing.T) {
	insts, err := seccompInsts(arch.X86_64, boxpolicy.SyscallPolicy, seccompRet, seccompRetErrno|errnoENOSYS)
	if err != nil {
		t.Fatal(err)
	}
	if len(insts) > 4096 {
		t.Fatalf("%d instructions: over the kernel's BPF_MAXINSNS", len(insts))
	}
	vm, err := bpf.NewVM(insts)
	if err != nil {
		t.Fatal(err)
	}
	const (
		allow  = seccompRetAllow
		eperm  = seccompRetErrno | errnoEPERM
		enosys = seccompRetErrno | errnoENOSYS
		kill   = seccompRetKillProcess
		hi     = 0xdead_beef_0000_0000 // garbage in the high half
		x86_64 = uint32(0xc000003e)
		i386   = uint32(0x40000003)
		arm64  = uint32(0xc00000b7)
	)
	nr := func(name string) uint32 { return uint32(arch.X86_64.SyscallNames[name]) }
	cases := []struct {
		name string
		arch uint32
		nr   uint32
		args []uint64
		want uint32
	}{
		{"read", x86_64, nr("read"), nil, allow},
		{"exit_group", x86_64, nr("exit_group"), nil, allow},
		{"an unknown number", x86_64, 999, nil, enosys},
		{"a syscall the policy does not name (mbind)", x86_64, nr("mbind"), nil, enosys},
		{"unshare", x86_64, nr("unshare"), []uint64{boxpolicy.CloneNewUser}, eperm},
		{"ptrace", x86_64, nr("ptrace"), nil, eperm},
		{"io_uring_setup", x86_64, nr("io_uring_setup"), nil, eperm},
		{"clone3", x86_64, nr("clone3"), nil, enosys},
		{"i386 read", i386, 3, nil, kill},
		{"i386 unshare", i386, 310, []uint64{boxpolicy.CloneNewUser}, kill},
		{"arm64 read", arm64, 63, nil, kill},
		{"x32 read", x86_64, 0x40000000 | nr("read"), nil, enosys},
		{"x32 unshare", x86_64, 0x40000000 | nr("unshare"), nil, enosys},
		{"x32 ptrace", x86_64, 0x40000000 | 521, nil, enosys},
		{"a negative number", x86_64, 0xffffffff, nil, enosys},
		{"clone a thread", x86_64, nr("clone"), []uint64{0x3d0f00}, allow},
		{"fork by clone", x86_64, nr("clone"), []uint64{0x01200011}, allow},
		{"clone NEWUSER", x86_64, nr("clone"), []uint64{boxpolicy.CloneNewUser | 17}, eperm},
		{"clone NEWNET", x86_64, nr("clone"), []uint64{boxpolicy.CloneNewNet | 17}, eperm},
		{"clone NEWNS", x86_64, nr("clone"), []uint64{boxpolicy.CloneNewNS | 17}, eperm},
		{"socket AF_INET", x86_64, nr("socket"), []uint64{boxpolicy.AFInet, 1, 0}, allow},
		{"socket AF_INET6", x86_64, nr("socket"), []uint64{boxpolicy.AFInet6, 2, 0}, allow},
		{"socket AF_UNIX", x86_64, nr("socket"), []uint64{boxpolicy.AFUnix, 1, 0}, allow},
		{"socket AF_INET, high half dirty", x86_64, nr("socket"), []uint64{hi | boxpolicy.AFInet, 1, 0}, allow},
		{"socket AF_NETLINK route", x86_64, nr("socket"), []uint64{boxpolicy.AFNetlink, 3, 0}, allow},
		{"socket AF_NETLINK route, high half dirty", x86_64, nr("socket"), []uint64{boxpolicy.AFNetlink, 3, hi}, allow},
		{"socket AF_NETLINK sock_diag", x86_64, nr("socket"), []uint64{boxpolicy.AFNetlink, 3, 4}, eperm},
		{"socket AF_NETLINK audit", x86_64, nr("socket"), []uint64{boxpolicy.AFNetlink, 3, 9}, eperm},
		{"socket AF_VSOCK", x86_64, nr("socket"), []uint64{boxpolicy.AFVsock, 1, 0}, eperm},
		{"socket AF_VSOCK, high half dirty", x86_64, nr("socket"), []uint64{hi | boxpolicy.AFVsock, 1, 0}, eperm},
		{"socket AF_PACKET", x86_64, nr("socket"), []uint64{boxpolicy.AFPacket, 3, 0x300}, eperm},
		{"socket AF_ALG", x86_64, nr("socket"), []uint64{38, 5, 0}, eperm},
		{"socket AF_BLUETOOTH", x86_64, nr("socket"), []uint64{31, 3, 0}, eperm},
		{"socketpair AF_UNIX", x86_64, nr("socketpair"), []uint64{boxpolicy.AFUnix, 1, 0}, allow},
		{"socketpair AF_INET", x86_64, nr("socketpair"), []uint64{boxpolicy.AFInet, 1, 0}, eperm},
		{"ioctl TCGETS", x86_64, nr("ioctl"), []uint64{0, 0x5401}, allow},
		{"ioctl FIONREAD", x86_64, nr("ioctl"), []uint64{0, 0x541b}, allow},
		{"ioctl TIOCSTI", x86_64, nr("ioctl"), []uint64{0, boxpolicy.TIOCSTI}, eperm},
		{"ioctl TIOCSTI, high half dirty", x86_64, nr("ioctl"), []uint64{0, hi | boxpolicy.TIOCSTI}, eperm},
		{"ioctl TIOCSTI, sign-extended", x86_64, nr("ioctl"), []uint64{0, 0xffffffff_00000000 | boxpolicy.TIOCSTI}, eperm},
		{"ioctl TIOCLINUX", x86_64, nr("ioctl"), []uint64{0, boxpolicy.TIOCLINUX}, eperm},
		{"prctl PR_SET_NAME", x86_64, nr("prctl"), []uint64{15}, allow},
		{"prctl PR_SET_DUMPABLE", x86_64, nr("prctl"), []uint64{4, 0}, allow},
		{"prctl PR_SET_NAME, high half dirty", x86_64, nr("prctl"), []uint64{hi | 15}, allow},
		{"prctl PR_CAP_AMBIENT", x86_64, nr("prctl"), []uint64{47, 2, 12}, eperm},
		{"prctl PR_SET_MM", x86_64, nr("prctl"), []uint64{35}, eperm},
		{"prctl PR_SET_PTRACER", x86_64, nr("prctl"), []uint64{0x59616d61}, eperm},
		{"prctl PR_SET_SECCOMP", x86_64, nr("prctl"), []uint64{22}, eperm},
		{"personality query", x86_64, nr("personality"), []uint64{0xffffffff}, allow},
		{"personality ADDR_NO_RANDOMIZE", x86_64, nr("personality"), []uint64{0x0040000}, eperm},
		{"personality READ_IMPLIES_EXEC", x86_64, nr("personality"), []uint64{0x0400000}, eperm},
	}
	for _, c := range cases {
		got, err := vm.Run(seccompData(c.arch, c.nr, c.args))
		if err != nil {
			t.Fatal(err)
		}
		if uint32(got) != c.want {
			t.Errorf("%s: %s, want %s", c.name, retName(uint32(got)), retName(c.want))
		}
	}
}

// TestSeccompProgramDispatch: for each policy, every x86_64 syscall
// number, with arguments of each kind, gets what a plain reading of the
// policy says (first matching rule, else the fall-through): no number is
// lost in the dispatch.
func TestSeccompProgramDispatch(t *testing.T) {
	for _, p := range []struct {
		name   string
		policy []boxpolicy.SyscallRule
		ret    func(boxpolicy.SyscallAction) uint32
		none   uint32
	}{
		{"box", boxpolicy.SyscallPolicy, seccompRet, seccompRetErrno | errnoENOSYS},
		{"deno", boxpolicy.DenoSyscallPolicy, seccompRet, seccompRetErrno | errnoENOSYS},
		{"deno, deriving", boxpolicy.DenoSyscallPolicy, notifyRet, seccompRetUserNotif},
	} {
		t.Run(p.name, func(t *testing.T) {
			insts, err := seccompInsts(arch.X86_64, p.policy, p.ret, p.none)
			if err != nil {
				t.Fatal(err)
			}
			vm, err := bpf.NewVM(insts)
			if err != nil {
				t.Fatal(err)
			}
			argSets := [][]uint64{nil, {boxpolicy.AFVsock, 1, 4}, {boxpolicy.AFNetlink, 0x5412, 0}, {15, 0x0040000}, {boxpolicy.CloneNewUser | 17}}
			for nr := range 600 {
				name, known := arch.X86_64.SyscallNumbers[nr]
				for _, args := range argSets {
					want := p.none
					if known {
						if a, ok := boxpolicy.PolicyAction(p.policy, name, args); ok {
							want = p.ret(a)
						}
					}
					got, err := vm.Run(seccompData(0xc000003e, uint32(nr), args))
					if err != nil {
						t.Fatal(err)
					}
					if uint32(got) != want {
						t.Errorf("%d %s %#x: %s, want %s", nr, name, args, retName(uint32(got)), retName(want))
					}
				}
			}
		})
	}
}

// TestSeccompProgramAssembles: the native programs load as they are (the
// conformance suites load them into real boxes and Deno processes).
func TestSeccompProgramAssembles(t *testing.T) {
	for _, p := range [][]boxpolicy.SyscallRule{boxpolicy.SyscallPolicy, boxpolicy.DenoSyscallPolicy} {
		raw, err := SeccompProgram(p, false)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%d instructions", len(raw))
	}
}

// seccompData lays out a struct seccomp_data for the interpreter, which
// loads words big-endian where the kernel loads them in native order:
// every word is stored big-endian at its native offset.
func seccompData(archID, nr uint32, args []uint64) []byte {
	b := make([]byte, 64)
	binary.BigEndian.PutUint32(b[offNr:], nr)
	binary.BigEndian.PutUint32(b[offArch:], archID)
	for i, a := range args {
		lo, hi := argOffsets(uint(i))
		binary.BigEndian.PutUint32(b[lo:], uint32(a))
		binary.BigEndian.PutUint32(b[hi:], uint32(a>>32))
	}
	return b
}

func retName(r uint32) string {
	switch {
	case r == seccompRetAllow:
		return "allow"
	case r == seccompRetKillProcess:
		return "kill"
	case r == seccompRetUserNotif:
		return "user notif"
	case r&0xffff0000 == seccompRetErrno:
		return fmt.Sprintf("errno %d", r&0xffff)
	}
	return fmt.Sprintf("%#x", r)
}
