//go:build !linux

package image

import "context"

// BuildFirecrackerKernel is supported on Linux only.
func BuildFirecrackerKernel(ctx context.Context, opts KernelOptions) (string, error) {
	return "", ErrUnsupported
}
