package cli

import (
	"flag"
	"fmt"
	"time"

	"kiln/internal/mcpserver"
)

// resourceFlags configure results as resources: what is inlined, what the
// server keeps for resources/read, and for how long.
type resourceFlags struct {
	inlineBytes      int
	keepOutput       int
	totalMiB, perMiB int64
	ttl              time.Duration
}

func (r *resourceFlags) register(fs *flag.FlagSet) {
	fs.IntVar(&r.inlineBytes, "inline-bytes", mcpserver.DefaultInlineBytes, "images and files larger than this come back as kiln:// resource links instead of inline")
	fs.IntVar(&r.keepOutput, "keep-output", mcpserver.DefaultKeepOutput, "bytes of stdout and of stderr the sandbox keeps per call (head and tail); beyond --max-output they are served as a kiln:// resource (0: keep only --max-output)")
	fs.Int64Var(&r.totalMiB, "resources-memory", mcpserver.DefaultResourceBytes>>20, "MiB of call outputs (full streams, big images, per-call files) the server holds for resources/read across all clients, oldest dropped first")
	fs.Int64Var(&r.perMiB, "resources-memory-per-principal", mcpserver.DefaultResourceBytesPerUser>>20, "MiB of call outputs held for one client (stdio process or HTTP token)")
	fs.DurationVar(&r.ttl, "resource-ttl", mcpserver.DefaultResourceTTL, "how long a call's outputs stay readable at most; they also go with their session")
}

// check refuses values that make no sense.
func (r *resourceFlags) check(maxOutput int) error {
	switch {
	case r.inlineBytes <= 0:
		return fmt.Errorf("--inline-bytes must be positive")
	case r.keepOutput < 0:
		return fmt.Errorf("--keep-output must not be negative")
	case r.totalMiB <= 0 || r.perMiB <= 0:
		return fmt.Errorf("--resources-memory and --resources-memory-per-principal must be positive")
	case r.ttl <= 0:
		return fmt.Errorf("--resource-ttl must be positive")
	case maxOutput <= 0:
		return fmt.Errorf("--max-output must be positive")
	}
	return nil
}

// kept is the output the sandbox keeps per stream.
func (r *resourceFlags) kept(maxOutput int) int { return max(maxOutput, r.keepOutput) }

func (r *resourceFlags) options(maxOutput int) mcpserver.ResourceOptions {
	return mcpserver.ResourceOptions{
		InlineBytes:          r.inlineBytes,
		InlineOutput:         maxOutput,
		MaxBytes:             r.totalMiB << 20,
		MaxBytesPerPrincipal: min(r.perMiB, r.totalMiB) << 20,
		TTL:                  r.ttl,
	}
}
