//go:build !linux

package image

import "context"

// Build is supported on Linux only.
func Build(ctx context.Context, opts Options) (*Image, error) { return nil, ErrUnsupported }
