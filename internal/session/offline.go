package session

import (
	"context"
	"fmt"

	"kiln/internal/sandbox"
)

type offlineKey struct{}

// Offline marks ctx as the context of a call for a client that may not
// use the network: the box the call runs in is cut off from the network
// first (sandbox.NetworkCutter), for good. A session box once cut stays
// cut; reset_session gives the session a fresh box.
func Offline(ctx context.Context) context.Context {
	return context.WithValue(ctx, offlineKey{}, true)
}

// IsOffline reports whether ctx was marked by Offline.
func IsOffline(ctx context.Context) bool {
	off, _ := ctx.Value(offlineKey{}).(bool)
	return off
}

// The mark is applied where a box is acquired, not by the tools: getBox,
// restoreBox and adopt cut a box before anything is loaded into it, and a
// session's live box is cut on the turn of the call that reaches it
// (ensure, WithLiveBox). Jobs copy the mark of the request that started
// them (newJob), since they run on the server's context.

// cutOrClose returns box cut off the network when ctx is offline, or
// destroys it if it cannot be cut.
func cutOrClose(ctx context.Context, box sandbox.Sandbox) (sandbox.Sandbox, error) {
	if err := cutIfOffline(ctx, box); err != nil {
		box.Close()
		return nil, err
	}
	return box, nil
}

// cutIfOffline cuts box's network when ctx is offline. Boxes that cannot
// be cut have no network to cut: only the jail attaches boxes to the
// egress gateway, and the other backends refuse an allowlist.
func cutIfOffline(ctx context.Context, box sandbox.Sandbox) error {
	if !IsOffline(ctx) {
		return nil
	}
	c, ok := inner(box).(sandbox.NetworkCutter)
	if !ok {
		return nil
	}
	if err := c.CutNetwork(); err != nil {
		return fmt.Errorf("cutting the sandbox off the network: %w", err)
	}
	return nil
}
