package bench

import (
	"context"
	"fmt"
	"time"
)

// coldStart measures what a stdio client pays each time it launches
// kiln: from starting `kiln mcp` to the result of its first print(2+2),
// through the MCP handshake, in session mode as a client starts it. The
// python3 spawn row is its baseline.
func (r *runner) coldStart(ctx context.Context) error {
	n := max(r.opts.Iterations/10, 5)
	r.progress("measuring %d cold starts of kiln mcp to a first result", n)
	var samples []time.Duration
	for range n {
		// Let the previous server's teardown end first.
		if err := sleep(ctx, r.opts.Settle); err != nil {
			return err
		}
		start := time.Now()
		srv, err := r.startServer(ctx, "session", r.opts.Pool)
		if err != nil {
			return err
		}
		_, err = srv.call(ctx, "run_python", runPython(printCode, ""), printWant)
		d := time.Since(start)
		srv.close()
		if err != nil {
			return fmt.Errorf("first call after start: %w", err)
		}
		samples = append(samples, d)
	}
	r.latency("coldstart", "cold kiln mcp start to first print(2+2)", samples,
		fmt.Sprintf("launch, MCP initialize, first run_python; session mode, pool %d", r.opts.Pool))
	return nil
}
