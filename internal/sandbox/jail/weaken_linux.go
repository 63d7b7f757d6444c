package jail

import (
	"encoding/binary"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// allowAll is a seccomp program of one instruction, RET ALLOW (struct
// sock_filter: op, jt, jf, k): what a box loads instead of the allowlist
// when the bench turns seccomp off, so the fork's steps stay the same.
var allowAll = binary.NativeEndian.AppendUint32(
	append(binary.NativeEndian.AppendUint16(nil, 0x06 /* BPF_RET|BPF_K */), 0, 0),
	0x7fff0000 /* SECCOMP_RET_ALLOW */)

// weaken applies benchWeakening to a forked box's plan.
func weaken(p *zygotePlan) *zygotePlan {
	w := benchWeakening()
	if w.seccomp {
		p.Seccomp = allowAll
	}
	if w.landlock {
		p.Landlock = nil
	}
	return p
}

// forkCgroup makes a forked box's cgroup; nil when the bench turned
// cgroups off.
func (b *Backend) forkCgroup(id string, lim sandbox.Limits) (*boxkit.CgroupGroup, error) {
	if benchWeakening().cgroups {
		return nil, nil
	}
	return b.cgroups.create(id, lim)
}
