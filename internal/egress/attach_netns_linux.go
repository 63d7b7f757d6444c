//go:build linux

package egress

import (
	"context"
	"fmt"
	"os"

	"kiln/internal/netnsrun"
)

// AttachNetNS makes a fresh network namespace and wires it to the gateway
// as Attach wires a box's own, for a box whose process does not exist yet:
// a runtime that joins a namespace given by path (runsc, through the OCI
// spec's network namespace) starts the box in it. It returns the
// attachment and that path, which stays valid until the Attachment is
// closed; Close releases the namespace, which vanishes once the box's
// processes have left it too.
//
// Use the namespace for one box only, and never again after that box: runsc
// --network=sandbox moves the interface's addresses and routes into its
// own network stack and leaves the namespace stripped.
//
// With an empty policy nothing is made: the path is empty and the box
// should get no network namespace of the gateway's at all (loopback only).
func (g *Gateway) AttachNetNS(ctx context.Context, box BoxInfo) (*Attachment, string, error) {
	if box.Policy.Empty() {
		return &Attachment{session: box.Session, core: g.c}, "", nil
	}
	ns, err := netnsrun.New()
	if err != nil {
		return nil, "", fmt.Errorf("making the box's network namespace: %w", err)
	}
	// The handle is held by this process until the attachment closes, so
	// its /proc path names the namespace for as long as the box may join
	// it, and nothing is left on the host (no bind mount under
	// /run/netns) if kiln dies. The handle is close-on-exec: no box
	// inherits it.
	path := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), int(ns))
	a, err := g.attachNS(ctx, ns, box) // takes ns over, also on error
	if err != nil {
		return nil, "", err
	}
	return a, path, nil
}
