package cli

import (
	"flag"

	"kiln/internal/session"
)

// snapshotFlags configure fork_session, snapshot_session and
// restore_session, and where kiln keeps state that outlives a box.
type snapshotFlags struct {
	stateDir string
	max      int
	quotaMiB int64
	// stateMiB caps every client's snapshots and hibernated sessions
	// together.
	stateMiB int64
}

func (f *snapshotFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.stateDir, "state-dir", "", "directory for state that outlives a sandbox (snapshots under <dir>/snapshots, kept across restarts, root only); default: a private temporary directory removed at exit")
	fs.IntVar(&f.max, "max-snapshots", session.DefaultMaxSnapshots, "named snapshots one session may keep (snapshot_session)")
	fs.Int64Var(&f.quotaMiB, "snapshot-quota", session.DefaultSnapshotQuota>>20, "disk space one client's snapshots may take, MiB")
	fs.Int64Var(&f.stateMiB, "state-quota", session.DefaultStateQuota>>20, "disk space every client's snapshots and hibernated sessions may take together, MiB; past it the oldest hibernated sessions are expired, and a save that still does not fit is refused")
}

// stateQuota is the cap on all saved state, in bytes.
func (f *snapshotFlags) stateQuota() int64 { return f.stateMiB << 20 }

func (f *snapshotFlags) options() session.SnapshotOptions {
	return session.SnapshotOptions{StateDir: f.stateDir, Max: f.max, Quota: f.quotaMiB << 20}
}
