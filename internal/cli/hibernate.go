package cli

import (
	"errors"
	"flag"
	"path/filepath"
	"time"

	"kiln/internal/session"
)

// hibernateFlags configure hibernation: with --state-dir (snapshots.go),
// idle sessions are saved to the one snapshot store, <--state-dir>/snapshots,
// and resumed at their next call, in this server or the next one. Dir is
// <--state-dir>/hibernated, where an older kiln kept them: the store moves
// what it finds there into itself at start.
type hibernateFlags struct {
	after           time.Duration
	ttl             time.Duration
	quotaMiB        int64
	checkpointEvery time.Duration
	saveTimeout     time.Duration
}

func (h *hibernateFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&h.after, "hibernate-after", session.DefaultHibernateAfter, "with --state-dir: a session unused this long is saved to disk and its sandbox destroyed; its next call resumes it")
	fs.DurationVar(&h.ttl, "hibernate-ttl", session.DefaultHibernateTTL, "with --state-dir: how long a hibernated session is kept on disk")
	fs.Int64Var(&h.quotaMiB, "hibernate-quota", session.DefaultHibernateQuota>>20, "with --state-dir: disk space of one client's saved sessions, MiB; past it, that client's oldest saved sessions are expired")
	fs.DurationVar(&h.checkpointEvery, "checkpoint-every", session.DefaultCheckpointEvery, "with --state-dir: a live session is saved after a call once its last save is older than this, bounding what kill -9 loses (0: only at idle and shutdown)")
	fs.DurationVar(&h.saveTimeout, "hibernate-shutdown-time", session.DefaultHibernateSaveTimeout, "with --state-dir: the most the server spends saving live sessions when it stops")
}

// options returns the session options for --state-dir (made and held by
// lockState); Dir is empty without one: sessions end with the server.
func (h *hibernateFlags) options(stateDir string) (session.HibernateOptions, error) {
	if stateDir == "" {
		return session.HibernateOptions{}, nil
	}
	if h.after < 0 || h.ttl < 0 || h.quotaMiB < 0 || h.checkpointEvery < 0 || h.saveTimeout < 0 {
		return session.HibernateOptions{}, errors.New("--hibernate-after, --hibernate-ttl, --hibernate-quota, --checkpoint-every and --hibernate-shutdown-time must not be negative")
	}
	dir, err := filepath.Abs(stateDir)
	if err != nil {
		return session.HibernateOptions{}, err
	}
	every := h.checkpointEvery
	if every == 0 {
		every = -1 // off
	}
	return session.HibernateOptions{
		Dir:             filepath.Join(dir, "hibernated"),
		After:           h.after,
		TTL:             h.ttl,
		Quota:           h.quotaMiB << 20,
		CheckpointEvery: every,
		SaveTimeout:     h.saveTimeout,
	}, nil
}
