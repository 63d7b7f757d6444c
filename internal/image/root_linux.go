package image

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
)

// BuildRoot builds the Debian root filesystem every image of opts starts
// from (the cached base, built first if need be) and returns its
// directory and the agent to install in it. The box image of the
// Kubernetes backend (package image/oci) is packed from it.
func BuildRoot(ctx context.Context, opts Options) (root, agent string, err error) {
	opts, err = opts.withDefaults()
	if err != nil {
		return "", "", err
	}
	if opts.Agent == "" {
		return "", "", ErrNoAgent
	}
	if os.Geteuid() != 0 {
		return "", "", errors.New("building image: needs root (debootstrap and chroot)")
	}
	if err := os.MkdirAll(opts.CacheDir, 0o755); err != nil {
		return "", "", fmt.Errorf("creating cache dir: %w", err)
	}
	log := opts.Logger
	unlock, err := lockDir(ctx, opts.CacheDir, log)
	if err != nil {
		return "", "", err
	}
	b, err := buildBase(ctx, opts, log)
	unlock()
	if err != nil {
		return "", "", fmt.Errorf("building image base: %w", err)
	}
	return b.rootfs(), opts.Agent, nil
}

// Step runs fn as one named build step, logging its start, progress and
// end.
func Step(ctx context.Context, log *slog.Logger, name string, fn func(context.Context) error) error {
	return step(ctx, log, name, fn)
}
