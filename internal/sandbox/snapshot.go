package sandbox

import (
	"context"
	"time"
)

// Snapshots: saving a live box to a directory and starting boxes from one.
//
// A snapshot is a directory the host owns (mode 0700, root only) holding a
// manifest (manifest.json, a SnapshotInfo) and whatever its format needs.
// Two levels exist:
//
//   - state level (FormatState): the workspace's files and the Python
//     kernel's globals, saved variable by variable inside the box by the
//     agent. Every agent-hosted backend has it. What cannot be saved is
//     named in SnapshotInfo.Dropped, never silently lost. The host only
//     moves bytes; it never decodes a box's pickles.
//   - kernel level (a backend's own format): the whole box, processes and
//     kernel state, as gVisor's checkpoint or a VM's migration stream.
//
// A restored box is reseeded (RNGs, clock) by construction, whatever the
// level, and enforces the Spec it is restored with, not the one it was
// saved under.

// Snapshot formats. A manifest names one with its version; a reader refuses
// a format or version it does not know, with an error that names both.
const (
	FormatState = "kiln-state/1"
)

// ManifestName is the manifest's file name in a snapshot directory.
const ManifestName = "manifest.json"

// StateArchive is the file name of a state-level snapshot's archive in its
// directory: opaque bytes the box made, never decoded by the host.
const StateArchive = "state.tar"

// SnapshotInfo is a snapshot's manifest and what saving it measured.
type SnapshotInfo struct {
	Format  string        `json:"format"`  // FormatState, or a backend's own
	Backend string        `json:"backend"` // the backend that saved it
	Created time.Time     `json:"created"`
	Bytes   int64         `json:"bytes"` // on disk, every file of the snapshot
	Took    time.Duration `json:"took"`  // how long saving took
	// SHA256 is the hex digest of a state-level snapshot's archive
	// (StateArchive): a restore refuses an archive that does not match.
	SHA256 string `json:"sha256,omitempty"`
	// Saved names the kernel globals that were saved (state level).
	Saved []string `json:"saved,omitempty"`
	// Dropped names what could not be saved and why, one entry each
	// ("gen: cannot pickle 'generator' object").
	Dropped []string `json:"dropped,omitempty"`
}

// Snapshotter is implemented by boxes that can save themselves. Snapshot
// writes a snapshot of the box's current state into dir, which exists and
// is empty, and returns its manifest (also written to dir). The box keeps
// running. It must not be called while a call runs in the box.
type Snapshotter interface {
	Snapshot(ctx context.Context, dir string) (*SnapshotInfo, error)
}

// Restorer is implemented by backends with a kernel-level format of their
// own: Restore starts a box from such a snapshot directory. It may be called
// many times on one directory; the boxes it returns share nothing writable.
//
// State-level snapshots need no Restorer: the package's Restore function
// starts a fresh box with Backend.Create and loads the state into it, on
// every agent-hosted backend. Restore reads the manifest and picks the path.
type Restorer interface {
	Restore(ctx context.Context, spec Spec, dir string) (Sandbox, error)
}
