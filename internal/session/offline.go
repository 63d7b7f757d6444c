package session

import (
	"context"
	"fmt"

	"kiln/internal/sandbox"
)

type netKey struct{}

// netRule is what a call's client may reach: nothing (offline), or the
// hosts of its own allowlist (within the server's).
type netRule struct {
	offline bool
	hosts   []string // nil: the server's allowlist, unnarrowed
}

// Offline marks ctx as the context of a call for a client that may not
// use the network: the box the call runs in is cut off from the network
// first (sandbox.NetworkCutter), for good. A session box once cut stays
// cut; reset_session gives the session a fresh box.
func Offline(ctx context.Context) context.Context {
	return context.WithValue(ctx, netKey{}, netRule{offline: true})
}

// WithNetwork marks ctx as the context of a call for a client whose
// allowlist the operator set: the box the call runs in is narrowed to
// hosts first (sandbox.NetworkCutter.RestrictNetwork), for good. An
// empty hosts is Offline.
func WithNetwork(ctx context.Context, hosts []string) context.Context {
	if len(hosts) == 0 {
		return Offline(ctx)
	}
	return context.WithValue(ctx, netKey{}, netRule{hosts: hosts})
}

// IsOffline reports whether ctx was marked by Offline.
func IsOffline(ctx context.Context) bool {
	r, _ := ctx.Value(netKey{}).(netRule)
	return r.offline
}

// withNetOf gives ctx the network mark of from, for work that outlives
// the request that started it (a background job).
func withNetOf(ctx, from context.Context) context.Context {
	if r, ok := from.Value(netKey{}).(netRule); ok {
		return context.WithValue(ctx, netKey{}, r)
	}
	return ctx
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

// cutIfOffline cuts box's network when ctx is offline, and narrows it to
// the client's allowlist when ctx has one. Boxes that cannot be cut have
// no network to cut: every backend that attaches boxes to the egress
// gateway implements sandbox.NetworkCutter, and the rest refuse an
// allowlist (sandboxtest.Egress checks the first).
func cutIfOffline(ctx context.Context, box sandbox.Sandbox) error {
	r, ok := ctx.Value(netKey{}).(netRule)
	if !ok {
		return nil
	}
	c, ok := inner(box).(sandbox.NetworkCutter)
	if !ok {
		return nil
	}
	if r.offline {
		if err := c.CutNetwork(); err != nil {
			return fmt.Errorf("cutting the sandbox off the network: %w", err)
		}
		return nil
	}
	if err := c.RestrictNetwork(r.hosts); err != nil {
		return fmt.Errorf("narrowing the sandbox's network to the client's allowlist: %w", err)
	}
	return nil
}
