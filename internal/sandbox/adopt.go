package sandbox

import (
	"context"
	"errors"
)

// ErrNoBox is Adopter.Adopt's answer when no box holds the key.
var ErrNoBox = errors.New("sandbox: no box holds that session")

// Adopter is implemented by backends whose boxes outlive the server process
// that made them and can be found and taken over by another one (the
// kubernetes backend: any kiln replica finds a session's Pod by its labels
// and attaches to it). The session layer binds a session's new box to the
// session's key, and adopts the key's box before it makes a new one, so a
// session continues, kernel state and files kept, through whichever
// replica its client reaches.
type Adopter interface {
	// Bind records that box (made by this backend, possibly wrapped: it
	// is found by its ID) holds the session key.
	Bind(ctx context.Context, box Sandbox, key string) error
	// Adopt returns the live box that holds key, taken over from
	// whichever process holds it, or ErrNoBox.
	Adopt(ctx context.Context, key string) (Sandbox, error)
}

// Releaser is implemented by an Adopter whose boxes can be let go of
// alive (the cluster backend: its nodes keep a bound box whose front went
// for their orphan grace). When the server stops the ordinary way (a
// rolling update, SIGTERM), the session layer releases each session's
// box instead of destroying it, so another replica adopts it and the
// session goes on. A released box's Close only lets go of it.
type Releaser interface {
	// Release marks box (found by its ID) to be left to whoever adopts
	// it when it is closed. It fails for a box not bound to a session,
	// which Close then destroys as ever.
	Release(box Sandbox) error
}
