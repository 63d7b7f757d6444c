package microvm

import (
	"bytes"
	"fmt"
	"io"
	"os"

	"kiln/internal/agentproto"
)

// A template keeps its agent's hello in a file beside its snapshot, framed
// as on the wire: its clones replay it (sandbox.RestoreConn), since their
// agent said it before the snapshot.

// readHello reads a template agent's hello from its stream; its guest
// must have built itself from the plan whose digest is plan.
func readHello(r io.Reader, plan string) (agentproto.Hello, error) {
	var h agentproto.Hello
	if err := agentproto.ReadFrame(r, &h); err != nil {
		return h, err
	}
	if h.Error != "" {
		return h, fmt.Errorf("agent: %s", h.Error)
	}
	return h, checkPlan(h, plan)
}

// checkPlan refuses a guest whose hello does not name the box plan plan
// (a digest) as the one it built itself from.
func checkPlan(h agentproto.Hello, plan string) error {
	switch h.Plan {
	case plan:
		return nil
	case "":
		return ErrOldImage
	}
	return fmt.Errorf("microvm: the guest built its box from plan %q, not from the plan sent (%q)", h.Plan, plan)
}

// writeHello stores h in the file path.
func writeHello(path string, h agentproto.Hello) error {
	var b bytes.Buffer
	if err := agentproto.WriteFrame(&b, &h); err != nil {
		return err
	}
	return os.WriteFile(path, b.Bytes(), 0o600)
}

// loadHello reads the hello stored in the file path, which names plan.
func loadHello(path, plan string) (agentproto.Hello, error) {
	var h agentproto.Hello
	f, err := os.Open(path)
	if err != nil {
		return h, err
	}
	defer f.Close()
	if err := agentproto.ReadFrame(f, &h); err != nil {
		return h, fmt.Errorf("reading %s: %w", path, err)
	}
	return h, checkPlan(h, plan)
}
