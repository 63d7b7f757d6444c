//go:build !linux

package image

import (
	"context"
	"log/slog"
)

// BuildRoot is supported on Linux only.
func BuildRoot(ctx context.Context, opts Options) (root, agent string, err error) {
	return "", "", ErrUnsupported
}

// Step runs fn.
func Step(ctx context.Context, log *slog.Logger, name string, fn func(context.Context) error) error {
	return fn(ctx)
}
