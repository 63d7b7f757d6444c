//go:build !linux

package gvisor

import (
	"context"
	"fmt"

	"kiln/internal/sandbox"
)

// Backend is not available on this OS: gVisor runs on Linux only.
type Backend struct{}

// New returns sandbox.ErrUnsupported: gVisor runs on Linux only.
func New(opts Options) (*Backend, error) {
	return nil, fmt.Errorf("gvisor backend: %w (gVisor runs on Linux only)", sandbox.ErrUnsupported)
}

func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	return nil, fmt.Errorf("gvisor backend: %w", sandbox.ErrUnsupported)
}

func (b *Backend) Check(ctx context.Context) error {
	return fmt.Errorf("gvisor backend: %w (gVisor runs on Linux only)", sandbox.ErrUnsupported)
}

// Warm is a no-op off Linux.
func (b *Backend) Warm(ctx context.Context, spec sandbox.Spec) error {
	return fmt.Errorf("gvisor backend: %w", sandbox.ErrUnsupported)
}

func (b *Backend) Info() Info { return Info{} }

func (b *Backend) Runtime() sandbox.Runtime { return sandbox.Runtime{} }

func (b *Backend) Close() error { return nil }
