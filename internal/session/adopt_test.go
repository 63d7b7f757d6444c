package session_test

import (
	"context"
	"sync"
	"testing"

	"kiln/internal/sandbox"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

// sharedBackend is an in-process stand-in for a backend whose boxes two
// servers can reach (kubernetes): boxes bound to a session key are handed
// to whichever manager adopts the key.
type sharedBackend struct {
	*sessiontest.Backend
	mu    sync.Mutex
	byID  map[string]sandbox.Sandbox
	byKey map[string]sandbox.Sandbox
}

func (b *sharedBackend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	box, err := b.Backend.Create(ctx, spec)
	if err == nil {
		b.mu.Lock()
		b.byID[box.ID()] = box
		b.mu.Unlock()
	}
	return box, err
}

func (b *sharedBackend) Bind(ctx context.Context, box sandbox.Sandbox, key string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.byKey[key] = b.byID[box.ID()]
	return nil
}

func (b *sharedBackend) Adopt(ctx context.Context, key string) (sandbox.Sandbox, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	box, ok := b.byKey[key]
	if !ok {
		return nil, sandbox.ErrNoBox
	}
	return keepOpen{box}, nil // the first manager still holds it and closes it
}

type keepOpen struct{ sandbox.Sandbox }

func (keepOpen) Close() error { return nil }

// TestSessionAdoptedByAnotherManager: a session made through one server
// continues through another, in the same box with its kernel's state,
// when the backend can hand boxes over (sandbox.Adopter).
func TestSessionAdoptedByAnotherManager(t *testing.T) {
	b := &sharedBackend{
		Backend: sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)}),
		byID:    map[string]sandbox.Sandbox{}, byKey: map[string]sandbox.Sandbox{},
	}
	one := session.NewManager(session.Options{Backend: b})
	two := session.NewManager(session.Options{Backend: b})
	t.Cleanup(func() { two.Close(); one.Close() })
	ctx := context.Background()
	s1, err := one.Get("alice", "work")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := s1.RunPython(ctx, "x = 41", liveness); err != nil || out.Error != nil {
		t.Fatalf("first server: %v %+v", err, out)
	}
	s2, err := two.Get("alice", "work")
	if err != nil {
		t.Fatal(err)
	}
	out, err := s2.RunPython(ctx, "x + 1", liveness)
	if err != nil || out.Result["text/plain"] != "42" || out.Fresh {
		t.Fatalf("second server: %v %+v", err, out)
	}
	// Another principal's session of the same name is not the same.
	s3, err := two.Get("bob", "work")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := s3.RunPython(ctx, "'x' in dir()", liveness); err != nil || out.Result["text/plain"] != "False" {
		t.Fatalf("another principal's session sees the state: %v %+v", err, out)
	}
}
