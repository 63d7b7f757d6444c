package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"

	"kiln/internal/agentproto"
)

// ReseedCode is the one list of what a box made from another's memory
// redraws before it runs any of the model's code: boxes restored from one
// checkpoint (RestoreConn runs it as ReseedCell), forked from one jail
// zygote (the zygote plan carries it to internal/kernel/zygote.py) or
// restored from one Pyodide snapshot (the wasm host's config carries it to
// its kernel.mjs) share their memory, so the random generators seeded
// while the template imported its libraries would draw the same numbers in
// every box, and tempfile would pick the same names. It is Python, run in
// a namespace of its own, and leaves no names behind. (Python's str hash
// seed stays shared; it cannot change in a live process.)
const ReseedCode = `import sys
m = sys.modules.get("random")
if m is not None:
    m.seed()
m = sys.modules.get("numpy.random")
if m is not None:
    m.seed()
m = sys.modules.get("tempfile")
if m is not None:
    m._name_sequence = None
`

// ReseedCell is ReseedCode as a cell for the kernel of a restored box.
const ReseedCell = `exec("""
` + ReseedCode + `""", {})`

// RestoreOptions tune RestoreConn; nil means defaults.
type RestoreOptions struct {
	// ReseedGuest, if set, gives the restored box's kernel fresh entropy
	// (and the time) before its agent is handed out. A VM needs it: its
	// kernel's RNG and clock are the template's. A box whose kernel is the
	// host's (or one that reseeds itself) does not.
	ReseedGuest func(ctx context.Context) error
	Conn        *AgentConnOptions
}

// RestoreConn connects to the agent of a box restored from a snapshot, and
// is the only way a restoring backend gets one, so that every restored box
// is reseeded: it runs opts.ReseedGuest, replays the template's hello (the
// restored agent said it already, before the snapshot), and runs
// ReseedCell in the agent's kernel if it has Python. On any error the box
// is destroyed.
func RestoreConn(ctx context.Context, id string, stream io.ReadWriteCloser, hello agentproto.Hello, destroy func() error, opts *RestoreOptions) (*AgentConn, error) {
	var o RestoreOptions
	if opts != nil {
		o = *opts
	}
	fail := func(err error) (*AgentConn, error) {
		err = errors.Join(err, stream.Close())
		if destroy != nil {
			err = errors.Join(err, destroy())
		}
		return nil, err
	}
	if o.ReseedGuest != nil {
		if err := o.ReseedGuest(ctx); err != nil {
			return fail(fmt.Errorf("reseeding guest: %w", err))
		}
	}
	var frame bytes.Buffer
	if err := agentproto.WriteFrame(&frame, &hello); err != nil {
		return fail(fmt.Errorf("replaying hello: %w", err))
	}
	c, err := DialAgent(ctx, id, &replayStream{r: io.MultiReader(&frame, stream), ReadWriteCloser: stream}, destroy, o.Conn)
	if err != nil {
		return nil, err
	}
	if hello.Python != "" {
		if _, err := c.RunPython(ctx, ReseedCell, ExecOptions{MaxOutput: 4096}); err != nil {
			c.Close()
			return nil, fmt.Errorf("reseeding restored box: %w", err)
		}
	}
	return c, nil
}

// replayStream reads r (a replayed hello, then the stream) and writes to
// and closes the stream.
type replayStream struct {
	r io.Reader
	io.ReadWriteCloser
}

func (s *replayStream) Read(p []byte) (int, error) { return s.r.Read(p) }
