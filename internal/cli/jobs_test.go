package cli

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"kiln/internal/session"
)

// TestJobFlags: kiln mcp and kiln serve list the job flags, and they
// reach the session manager's options.
func TestJobFlags(t *testing.T) {
	for _, cmd := range []string{"mcp", "serve"} {
		_, _, errs := kiln(t, cmd, "-h")
		for _, f := range []string{"-max-job-time", "-job-retention", "-max-jobs-per-principal", "-jobs-memory", "-jobs-memory-per-principal"} {
			if !strings.Contains(errs, "  "+f+" ") {
				t.Errorf("kiln %s -h does not list %s", cmd, f)
			}
		}
		if !strings.Contains(errs, "(default 1h0m0s)") {
			t.Errorf("kiln %s -h does not show the 1 h default of a job", cmd)
		}
	}
	var c common
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.register(fs)
	if err := fs.Parse([]string{"--max-job-time", "2h", "--job-retention", "5m", "--max-jobs-per-principal", "3", "--jobs-memory", "100", "--jobs-memory-per-principal", "10"}); err != nil {
		t.Fatal(err)
	}
	want := session.JobOptions{MaxTime: 2 * time.Hour, Retention: 5 * time.Minute, PerPrincipal: 3, MaxBytes: 100 << 20, MaxBytesPerPrincipal: 10 << 20}
	if got := c.jobs.options(); got != want {
		t.Errorf("options %+v, want %+v", got, want)
	}
}
