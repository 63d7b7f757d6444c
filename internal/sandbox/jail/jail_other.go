//go:build !linux

package jail

import (
	"context"
	"fmt"

	"kiln/internal/sandbox"
)

// Backend is unavailable off Linux.
type Backend struct{}

// New reports that the jail needs Linux.
func New(opts Options) (*Backend, error) {
	return nil, fmt.Errorf("jail: %w: it needs Linux namespaces", sandbox.ErrUnsupported)
}

// ServerCgroupPattern is the group a jail server would have on Linux.
func ServerCgroupPattern() string { return ServerCgroupParent + "/{pid}" }

// MaybeInit does nothing off Linux.
func MaybeInit() {}

func (b *Backend) Name() string { return "jail" }

func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	return nil, sandbox.ErrUnsupported
}

func (b *Backend) Runtime() sandbox.Runtime { return sandbox.Runtime{} }

func (b *Backend) Close() error { return nil }

func (b *Backend) Leftovers() []string { return nil }
