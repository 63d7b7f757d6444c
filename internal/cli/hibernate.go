package cli

import (
	"context"
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
	saves           savesBucket
}

// savesBucket is where saves are shared with other servers (--saves-bucket,
// feature_s3.go): each session's newest save, for whichever server its
// client reaches next.
type savesBucket struct {
	bucket, endpoint, region string
}

func (h *hibernateFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&h.after, "hibernate-after", session.DefaultHibernateAfter, "with --state-dir: a session unused this long is saved to disk and its sandbox destroyed; its next call resumes it")
	fs.DurationVar(&h.ttl, "hibernate-ttl", session.DefaultHibernateTTL, "with --state-dir: how long a hibernated session is kept on disk")
	fs.Int64Var(&h.quotaMiB, "hibernate-quota", session.DefaultHibernateQuota>>20, "with --state-dir: disk space of one client's saved sessions, MiB; past it, that client's oldest saved sessions are expired")
	fs.DurationVar(&h.checkpointEvery, "checkpoint-every", session.DefaultCheckpointEvery, "with --state-dir: a live session is saved after a call once its last save is older than this, bounding what kill -9 loses (0: only at idle and shutdown)")
	fs.DurationVar(&h.saveTimeout, "hibernate-shutdown-time", session.DefaultHibernateSaveTimeout, "with --state-dir: the most the server spends saving live sessions when it stops")
	fs.StringVar(&h.saves.bucket, "saves-bucket", "", "with --state-dir: s3://BUCKET[/PREFIX], an S3-compatible bucket that holds each session's newest save for every server that shares it, so a session resumes on whichever server its client reaches next (keys: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, or the platform's identity)")
	fs.StringVar(&h.saves.endpoint, "saves-endpoint", "", "the --saves-bucket server's URL, https://host[:port] (http:// only for a server nothing else can see the traffic to); default: AWS S3")
	fs.StringVar(&h.saves.region, "saves-region", "", "the --saves-bucket bucket's region (default: $AWS_REGION, else the server says)")
}

// options returns the session options for --state-dir (made and held by
// lockState); Dir is empty without one: sessions end with the server.
func (h *hibernateFlags) options(ctx context.Context, stateDir string) (session.HibernateOptions, error) {
	if stateDir == "" {
		if h.saves != (savesBucket{}) {
			return session.HibernateOptions{}, errors.New("--saves-bucket needs --state-dir: the bucket holds a copy of what the server saves there")
		}
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
	o := session.HibernateOptions{
		Dir:             filepath.Join(dir, "hibernated"),
		After:           h.after,
		TTL:             h.ttl,
		Quota:           h.quotaMiB << 20,
		CheckpointEvery: every,
		SaveTimeout:     h.saveTimeout,
	}
	if h.saves != (savesBucket{}) {
		if h.saves.bucket == "" {
			return o, errors.New("--saves-endpoint and --saves-region need --saves-bucket")
		}
		if o.Shared, err = openSharedSaves(ctx, h.saves); err != nil {
			return o, err
		}
	}
	return o, nil
}
