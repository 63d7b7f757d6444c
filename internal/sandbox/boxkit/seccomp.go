package boxkit

import (
	"encoding/binary"
	"fmt"
	"slices"

	"kiln/internal/boxpolicy"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
)

// A seccomp program assembled from a syscall policy (boxpolicy.SyscallPolicy,
// boxpolicy.DenoSyscallPolicy). It is written out here rather than by a
// filter library so that every entry into the kernel is decided by kiln: a
// library that jumps to its default action for a foreign architecture
// turns a denylist into nothing for the i386 entry, and compares int
// arguments on all 64 bits, which a caller can dirty in the high half.
// (The jail's copy of this assembler, internal/sandbox/jail/seccomp.go, is
// the same program; it is to become a reader of this one.)
//
//	ld  arch;  jeq native ? next : kill process   (i386 int 0x80, arm32, …)
//	ld  nr;    jge 0x40000000 ? ENOSYS : next     (x32 numbers, on x86_64)
//	the first hotSyscalls the policy names, one by one:
//	    jeq nr ? ja its block : next
//	a binary search on the number for the others, whose leaves are
//	    jeq nr ? ja its block : next; …; ret ENOSYS
//	the blocks, one for each distinct set of rules:
//	    each rule: its argument checks, then ret its action
//	    ret ENOSYS when none matched
//
// The dispatch only compares the number it loaded and every block ends in
// a return, so no block's loads of arguments reach another comparison.
// A program assembled to derive a policy returns SECCOMP_RET_USER_NOTIF
// wherever this one refuses a native call.

// Return values of a seccomp filter (linux/seccomp.h) and errnos.
const (
	seccompRetKillProcess = 0x80000000
	seccompRetErrno       = 0x00050000
	seccompRetAllow       = 0x7fff0000
	seccompRetUserNotif   = 0x7fc00000
	errnoEPERM            = 1
	errnoENOSYS           = 38
	x32SyscallBit         = 0x40000000

	// hotSyscalls are dispatched one by one before the search: the
	// policy names its most frequent calls first.
	hotSyscalls = 16
)

// Offsets in struct seccomp_data.
const (
	offNr   = 0
	offArch = 4
	offArgs = 16
)

func seccompRet(a boxpolicy.SyscallAction) uint32 {
	switch a {
	case boxpolicy.Allow:
		return seccompRetAllow
	case boxpolicy.Deny:
		return seccompRetErrno | errnoEPERM
	default:
		return seccompRetErrno | errnoENOSYS
	}
}

// notifyRet allows what the policy allows and notifies the rest.
func notifyRet(a boxpolicy.SyscallAction) uint32 {
	if a == boxpolicy.Allow {
		return seccompRetAllow
	}
	return seccompRetUserNotif
}

// seccompInsts assembles policy for the architecture info names: a rule
// returns ret of its action, a call no rule matches gets none.
func seccompInsts(info *arch.Info, policy []boxpolicy.SyscallRule, ret func(boxpolicy.SyscallAction) uint32, none uint32) ([]bpf.Instruction, error) {
	prog := []bpf.Instruction{
		bpf.LoadAbsolute{Off: offArch, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(info.ID), SkipTrue: 1},
		bpf.RetConstant{Val: seccompRetKillProcess},
		bpf.LoadAbsolute{Off: offNr, Size: 4},
	}
	if info.ID == arch.X86_64.ID {
		prog = append(prog,
			bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: x32SyscallBit, SkipFalse: 1},
			bpf.RetConstant{Val: seccompRetErrno | errnoENOSYS},
		)
	}
	// The rules of each syscall, in the order the policy names them.
	var order []int
	rules := map[int][]boxpolicy.SyscallRule{}
	for _, r := range policy {
		for _, name := range r.Names {
			nr, ok := info.SyscallNames[name]
			if !ok {
				continue // not on this architecture
			}
			if _, seen := rules[nr]; !seen {
				order = append(order, nr)
			}
			rules[nr] = append(rules[nr], r)
		}
	}
	// One block a distinct set of rules: most syscalls share "ret allow".
	var blocks [][]bpf.Instruction
	index := map[int]int{}
	same := map[string]int{}
	for _, nr := range order {
		b, err := syscallBlock(rules[nr], ret, none)
		if err != nil {
			return nil, fmt.Errorf("syscall %s: %w", info.SyscallNumbers[nr], err)
		}
		key := fmt.Sprint(b)
		i, ok := same[key]
		if !ok {
			i = len(blocks)
			blocks = append(blocks, b)
			same[key] = i
		}
		index[nr] = i
	}
	// Dispatch: the hottest syscalls one by one, then a binary search on
	// the number. "jeq nr, ja its block" for each; the jumps to blocks
	// are patched once the blocks have their places.
	type far struct{ at, block int }
	var jumps []far
	dispatch := func(nr int) {
		prog = append(prog, bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(nr), SkipFalse: 1})
		jumps = append(jumps, far{len(prog), index[nr]})
		prog = append(prog, bpf.Jump{})
	}
	hot := min(hotSyscalls, len(order))
	for _, nr := range order[:hot] {
		dispatch(nr)
	}
	cold := slices.Clone(order[hot:])
	slices.Sort(cold)
	var search func(nrs []int)
	search = func(nrs []int) {
		if len(nrs) <= 4 {
			for _, nr := range nrs {
				dispatch(nr)
			}
			prog = append(prog, bpf.RetConstant{Val: none})
			return
		}
		mid := len(nrs) / 2
		prog = append(prog, bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: uint32(nrs[mid]), SkipTrue: 1})
		toLow := len(prog)
		prog = append(prog, bpf.Jump{})
		search(nrs[mid:])
		prog[toLow] = bpf.Jump{Skip: uint32(len(prog) - toLow - 1)}
		search(nrs[:mid])
	}
	search(cold)
	start := make([]int, len(blocks))
	for i, b := range blocks {
		start[i] = len(prog)
		prog = append(prog, b...)
	}
	for _, j := range jumps {
		prog[j.at] = bpf.Jump{Skip: uint32(start[j.block] - j.at - 1)}
	}
	return prog, nil
}

// syscallBlock is the code of one syscall's rules: the first that matches
// returns its action; when none does, none.
func syscallBlock(rules []boxpolicy.SyscallRule, ret func(boxpolicy.SyscallAction) uint32, none uint32) ([]bpf.Instruction, error) {
	var block []bpf.Instruction
	for _, r := range rules {
		var code []bpf.Instruction
		var fails []int // jumps to the end of this rule
		for _, c := range r.Args {
			if c.Index > 5 || c.Mask == 0 || c.Value&^c.Mask != 0 {
				return nil, fmt.Errorf("invalid argument check %+v", c)
			}
			lo, hi := argOffsets(c.Index)
			for _, half := range []struct {
				off        uint32
				mask, want uint32
			}{{lo, uint32(c.Mask), uint32(c.Value)}, {hi, uint32(c.Mask >> 32), uint32(c.Value >> 32)}} {
				if half.mask == 0 {
					continue
				}
				code = append(code, bpf.LoadAbsolute{Off: half.off, Size: 4})
				if half.mask != 0xffffffff {
					code = append(code, bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: half.mask})
				}
				fails = append(fails, len(code))
				code = append(code, bpf.JumpIf{Cond: bpf.JumpEqual, Val: half.want})
			}
		}
		code = append(code, bpf.RetConstant{Val: ret(r.Action)})
		for _, i := range fails {
			skip := len(code) - i - 1
			if skip > 255 {
				return nil, fmt.Errorf("rule too long: %+v", r)
			}
			j := code[i].(bpf.JumpIf)
			j.SkipFalse = uint8(skip)
			code[i] = j
		}
		block = append(block, code...)
		if len(r.Args) == 0 {
			return block, nil // later rules are unreachable
		}
	}
	return append(block, bpf.RetConstant{Val: none}), nil
}

// argOffsets are the offsets of the low and high halves of argument i in
// struct seccomp_data.
func argOffsets(i uint) (lo, hi uint32) {
	off := uint32(offArgs + 8*i)
	if binary.NativeEndian.Uint16([]byte{1, 0}) == 1 {
		return off, off + 4
	}
	return off + 4, off
}

// SeccompProgram assembles policy for the architecture kiln was built
// for. A call no rule matches fails with ENOSYS. With notify, every call
// the policy does not allow (refused by a rule, or by none) waits for a
// seccomp user notification instead: a test that derives a policy answers
// them.
func SeccompProgram(policy []boxpolicy.SyscallRule, notify bool) ([]bpf.RawInstruction, error) {
	info, err := arch.GetInfo("")
	if err != nil {
		return nil, fmt.Errorf("finding syscall table: %w", err)
	}
	ret, none := seccompRet, uint32(seccompRetErrno|errnoENOSYS)
	if notify {
		ret, none = notifyRet, seccompRetUserNotif
	}
	insts, err := seccompInsts(info, policy, ret, none)
	if err != nil {
		return nil, fmt.Errorf("assembling seccomp policy: %w", err)
	}
	raw, err := bpf.Assemble(insts)
	if err != nil {
		return nil, fmt.Errorf("assembling seccomp program: %w", err)
	}
	return raw, nil
}
