//go:build !linux

package microvm

import (
	"context"
	"log/slog"

	"kiln/internal/sandbox"
)

// Backend is the microVM backend; it runs on Linux only.
type Backend struct {
	opts  Options
	log   *slog.Logger
	notes []string
}

// New reports that microVMs are not supported on this OS.
func New(opts Options) (*Backend, error) { return nil, sandbox.ErrUnsupported }

func (b *Backend) Check(ctx context.Context) error { return sandbox.ErrUnsupported }

func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	return nil, sandbox.ErrUnsupported
}

func (b *Backend) Close() error { return nil }

func (b *Backend) Warm(ctx context.Context, spec sandbox.Spec) error {
	return sandbox.ErrUnsupported
}

// Firecracker is the Firecracker backend; it runs on Linux only.
type Firecracker struct{}

// CheckFirecrackerHost reports that Firecracker is not supported on this
// OS.
func CheckFirecrackerHost(bin string) (string, error) { return "", sandbox.ErrUnsupported }

// NewFirecracker reports that Firecracker is not supported on this OS.
func NewFirecracker(opts FirecrackerOptions) (*Firecracker, error) {
	return nil, sandbox.ErrUnsupported
}

func (f *Firecracker) Name() string { return "firecracker" }

func (f *Firecracker) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Sandbox, error) {
	return nil, sandbox.ErrUnsupported
}

func (f *Firecracker) Close() error { return nil }

// MaybeInit does nothing off Linux.
func MaybeInit() {}
