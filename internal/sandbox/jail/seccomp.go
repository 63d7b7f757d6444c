package jail

import (
	"golang.org/x/net/bpf"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox/boxkit"
)

// seccompRaw is the jail's syscall filter: boxpolicy.SyscallPolicy,
// assembled by the one seccomp assembler every confined process of kiln's
// uses (boxkit.SeccompProgram, whose tests check the program against the
// policy for every syscall number). A call no rule names fails with
// ENOSYS; an i386 or x32 entry never reaches a rule.
func seccompRaw() ([]bpf.RawInstruction, error) {
	return boxkit.SeccompProgram(boxpolicy.SyscallPolicy, false)
}
