package egress

import (
	"time"

	"kiln/internal/event"
)

// observe tells Options.Observer of one attempt of box a and its verdict.
// The name and reason are bounded here too, since an error's text can
// quote what the box sent.
func (c *core) observe(a *Attachment, via, name string, port uint16, verdict, reason string) {
	if c.opts.Observer == nil {
		return
	}
	c.opts.Observer.Observe(event.Egress{
		Time: time.Now(), Box: a.session, Via: via, Name: clip(name, maxNameLen), Port: port,
		Verdict: verdict, Reason: clip(reason, maxReasonLen),
	})
}
