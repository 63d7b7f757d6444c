//go:build !linux

package image

import "context"

// BuildOCI is supported on Linux only.
func BuildOCI(ctx context.Context, opts Options, o OCIOptions) (string, error) {
	return "", ErrUnsupported
}
