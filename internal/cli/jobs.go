package cli

import (
	"flag"
	"time"

	"kiln/internal/session"
)

// jobFlags bound background jobs (run tools with background: true).
type jobFlags struct {
	maxTime      time.Duration
	retention    time.Duration
	perPrincipal int
	// MiB of finished jobs' results held, in all and for one client.
	totalMiB, perMiB int64
}

func (j *jobFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&j.maxTime, "max-job-time", session.DefaultMaxJobTime, "time limit of a background job (background: true), and the most its timeout_s may ask for")
	fs.DurationVar(&j.retention, "job-retention", session.DefaultJobRetention, "how long a finished background job's result is kept for job_status")
	fs.IntVar(&j.perPrincipal, "max-jobs-per-principal", session.DefaultJobsPerPrincipal, "background jobs one client may hold, running or finished and kept")
	fs.Int64Var(&j.totalMiB, "jobs-memory", session.DefaultJobBytes>>20, "MiB of finished background jobs' results the server holds until job_status collects them, across all clients; past it the oldest are cut to a summary (exit status, ends of each stream)")
	fs.Int64Var(&j.perMiB, "jobs-memory-per-principal", session.DefaultJobBytesPerPrincipal>>20, "MiB of finished background jobs' results held for one client")
}

func (j *jobFlags) options() session.JobOptions {
	return session.JobOptions{MaxTime: j.maxTime, Retention: j.retention, PerPrincipal: j.perPrincipal,
		MaxBytes: j.totalMiB << 20, MaxBytesPerPrincipal: j.perMiB << 20}
}
