//go:build !linux

package image

import "context"

// BuildFieldHost needs Linux (debootstrap, chroot).
func BuildFieldHost(context.Context, FieldHostOptions) (*FieldHost, error) {
	return nil, ErrUnsupported
}
