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
