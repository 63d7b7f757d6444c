package sandbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// RestoreReport is what restoring a snapshot did.
type RestoreReport struct {
	Info *SnapshotInfo // the snapshot's manifest
	// Dropped names what the new box could not load (a module it cannot
	// import), one entry each; what saving dropped is in Info.Dropped.
	Dropped []string
	Took    time.Duration
}

// ErrSnapshotFormat is a snapshot in a format or version this kiln or
// this backend cannot restore.
var ErrSnapshotFormat = errors.New("sandbox: unknown snapshot format")

// Restore starts a box from the snapshot in dir, enforcing spec: with the
// backend's Restorer for a format of its own, else, for a state-level
// snapshot, a fresh box from Create with the state loaded into it and its
// random generators reseeded. It refuses a format or version it does not
// know, naming both.
func Restore(ctx context.Context, b Backend, spec Spec, dir string) (Sandbox, error) {
	box, _, err := RestoreWithReport(ctx, b, spec, dir)
	return box, err
}

// RestoreWithReport is Restore, also saying what the restore dropped.
func RestoreWithReport(ctx context.Context, b Backend, spec Spec, dir string) (Sandbox, *RestoreReport, error) {
	start := time.Now()
	info, err := ReadManifest(dir)
	if err != nil {
		return nil, nil, err
	}
	rep := &RestoreReport{Info: info}
	name, version, _ := strings.Cut(info.Format, "/")
	stateName, stateVersion, _ := strings.Cut(FormatState, "/")
	switch {
	case info.Format == FormatState:
	case name == stateName:
		return nil, nil, fmt.Errorf("%w: %s version %q (this kiln reads version %s); it was made by another kiln version", ErrSnapshotFormat, name, version, stateVersion)
	default:
		r, ok := b.(Restorer)
		if !ok {
			return nil, nil, fmt.Errorf("%w: %q (made by backend %q), which the %s backend cannot restore", ErrSnapshotFormat, info.Format, info.Backend, b.Name())
		}
		box, err := r.Restore(ctx, spec, dir)
		if err != nil {
			return nil, nil, fmt.Errorf("restoring snapshot: %w", err)
		}
		rep.Took = time.Since(start)
		return box, rep, nil
	}
	box, err := b.Create(ctx, spec)
	if err != nil {
		return nil, nil, fmt.Errorf("restoring snapshot: %w", err)
	}
	if rep.Dropped, err = loadInto(ctx, box, dir, info, b.Name()); err != nil {
		box.Close()
		return nil, nil, err
	}
	rep.Took = time.Since(start)
	return box, rep, nil
}

// LoadInto loads the state-level snapshot in dir into box, a fresh box
// (from Create or a pool), and reseeds its random generators; it returns
// what the box could not load. On an error box may hold part of the
// state: the caller destroys it. backend names box's backend in errors.
func LoadInto(ctx context.Context, box Sandbox, dir, backend string) (dropped []string, err error) {
	info, err := ReadManifest(dir)
	if err != nil {
		return nil, err
	}
	if info.Format != FormatState {
		return nil, fmt.Errorf("%w: %q; only %s snapshots load into a running box", ErrSnapshotFormat, info.Format, FormatState)
	}
	return loadInto(ctx, box, dir, info, backend)
}

func loadInto(ctx context.Context, box Sandbox, dir string, info *SnapshotInfo, backend string) ([]string, error) {
	l, ok := box.(StateLoader)
	if !ok {
		return nil, fmt.Errorf("restoring snapshot: the %s backend's boxes cannot load state: %w", backend, ErrUnsupported)
	}
	dropped, err := l.LoadState(ctx, dir, info)
	if err != nil {
		return nil, fmt.Errorf("restoring snapshot: %w", err)
	}
	// The loaded globals may hold generators of the saved box's random
	// modules' state; the modules themselves were imported fresh, but a
	// fork must not draw what its source draws.
	if _, err := box.RunPython(ctx, ReseedCell, ExecOptions{MaxOutput: 4096}); err != nil {
		return nil, fmt.Errorf("reseeding restored box: %w", err)
	}
	return dropped, nil
}
