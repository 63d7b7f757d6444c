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
}

func (j *jobFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&j.maxTime, "max-job-time", session.DefaultMaxJobTime, "time limit of a background job (background: true), and the most its timeout_s may ask for")
	fs.DurationVar(&j.retention, "job-retention", session.DefaultJobRetention, "how long a finished background job's result is kept for job_status")
	fs.IntVar(&j.perPrincipal, "max-jobs-per-principal", session.DefaultJobsPerPrincipal, "background jobs one client may hold, running or finished and kept")
}

func (j *jobFlags) options() session.JobOptions {
	return session.JobOptions{MaxTime: j.maxTime, Retention: j.retention, PerPrincipal: j.perPrincipal}
}
