package jail

import (
	"context"
	"errors"

	"kiln/internal/sandbox/boxkit"
)

// ZygoteStats is what the tests see of the template lifecycle.
type ZygoteStats = boxkit.TemplateStats

// ZygoteStatsOf returns b's template counts.
func ZygoteStatsOf(b *Backend) ZygoteStats { return b.zy.tpls.Stats() }

// WaitZygoteRotation waits until n replacements have become current.
func WaitZygoteRotation(ctx context.Context, b *Backend, n int) error {
	if b.zy == nil {
		return errors.New("the zygote is off")
	}
	return b.zy.tpls.WaitRotations(ctx, n)
}

// RootlessPremise says what this host lacks for a rootless jail whose
// code runs as a uid of its own, or nil: user namespaces that an ordinary
// user may create (a control runs /bin/true in one), newuidmap and
// newgidmap, and the user's subordinate id ranges.
func RootlessPremise() error {
	if err := userNamespaceControl(); err != nil {
		return err
	}
	_, err := detectSubIDs()
	return err
}

// CgroupError says why b's boxes have no cgroup limits, or nil.
func CgroupError(b *Backend) error { return b.cgErr }
