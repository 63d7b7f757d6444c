package jail

import (
	"errors"

	"kiln/internal/sandbox"
)

// Early boxes. A zygote template takes a python start and the preloads'
// imports (about a second for numpy, pandas and matplotlib) before it can
// fork anything, and a server builds it on its first box. A call that
// arrives before it is ready (sandbox.Spec.Urgent: a call waits for the
// box, the pool is not ahead) does not wait for it: its box starts
// directly, the way boxes start with --zygote=false, and without the
// preloads, so the call pays only for the imports its code makes. The
// template goes on warming in the background, and the pool's boxes,
// which nobody waits for, still come from it.

// errWarming: the template an urgent box would fork from is not ready.
var errWarming = errors.New("jail zygote still warming")

// earlyBoxes says whether urgent boxes may skip a warming template: not
// with a configured template (Options.Template), whose imports the tool
// description promises are done before a box is handed out.
func (b *Backend) earlyBoxes() bool { return b.opts.Template == "" }

// early turns spec into an early box's: started directly, no preloads.
func (b *Backend) early(spec *sandbox.Spec) {
	b.log.Debug("the zygote template is warming: starting an early box directly, without preloads", "id", spec.ID, "preload", spec.Preload)
	spec.Preload = nil
}
