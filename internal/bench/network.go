package bench

import (
	"context"
	"fmt"
	"time"
)

// netCostHost is the allowlist of the networked server: a name no box
// reaches. A box under any allowlist pays the same at creation (its link
// to the egress gateway, its firewall), and the calls never use it.
const netCostHost = "bench.invalid"

// network measures what a box's network costs at creation: per-call
// print(2+2) with no pool, so that every call makes its box, on a server
// without an allowlist and on one with --allow-net, one call to each in
// turn so that both see the same load. A backend that refuses --allow-net
// gets the row with its refusal.
func (r *runner) network(ctx context.Context) error {
	plain, err := r.startWarm(ctx, "per-call", 0)
	if err != nil {
		return err
	}
	defer plain.close()
	netted, err := r.startServerWith(ctx, "per-call", 0, "--allow-net", netCostHost)
	if err != nil {
		return fmt.Errorf("with --allow-net: %w", err)
	}
	defer netted.close()
	if err := r.warm(ctx, netted, "per-call"); err != nil {
		return fmt.Errorf("waiting for the networked server to warm up: %w", err)
	}
	r.progress("measuring a box's network at creation (per-call, no pool, alternating)")
	if err := sleep(ctx, r.opts.Settle); err != nil {
		return err
	}
	var without, with []time.Duration
	for range r.opts.Iterations {
		d, err := plain.call(ctx, "run_python", runPython(printCode, ""), printWant)
		if err != nil {
			return err
		}
		without = append(without, d)
		if d, err = netted.call(ctx, "run_python", runPython(printCode, ""), printWant); err != nil {
			return fmt.Errorf("with --allow-net: %w", err)
		}
		with = append(with, d)
	}
	r.latency("network-none", "per-call print(2+2), no pool, no network", without, "every call makes its box; alternating with the next row")
	r.latency("network-allow", "per-call print(2+2), no pool, --allow-net", with, "every call makes its box and attaches it to the egress gateway")
	if a, b := r.rep.get("network-none"), r.rep.get("network-allow"); a != nil && b != nil && a.P50 > 0 {
		b.Note += fmt.Sprintf("; p50 %+.1f ms (%.2f×) against no network in the same run", b.P50-a.P50, b.P50/a.P50)
	}
	return nil
}
