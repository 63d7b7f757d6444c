package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// What `kiln bench --backend cluster` adds: the bench starts the kiln node
// daemons itself, as its children, so that their boxes' CPU counts in its
// cgroup (under cgroup v1, where the jail's boxes stay in it); it measures
// a local jail server alongside, row by row; and it measures the per-call
// throughput at the most clients with one node, two, and so on up to all.

// nodeAddrRe finds the address in a node's "serving" log line.
var nodeAddrRe = regexp.MustCompile(`kiln node serving boxes to fronts.* addr=(\S+)`)

// nodeSet is the node daemons of a run.
type nodeSet struct {
	dir   string
	addrs []string
	procs []*exec.Cmd
}

// startNodes makes certificates and starts n `kiln node` daemons on
// loopback ports, and returns once each says it serves.
func (r *runner) startNodes(ctx context.Context, n int) (*nodeSet, error) {
	dir, err := os.MkdirTemp("", "kiln-bench-nodes-")
	if err != nil {
		return nil, err
	}
	ns := &nodeSet{dir: dir}
	certs := filepath.Join(dir, "certs")
	if out, err := exec.CommandContext(ctx, r.opts.Kiln, "node", "certs", "--dir", certs).CombinedOutput(); err != nil {
		ns.stop()
		return nil, fmt.Errorf("kiln node certs: %v: %s", err, out)
	}
	for i := range n {
		r.progress("starting kiln node %d of %d", i+1, n)
		cmd := exec.Command(r.opts.Kiln, "node", "--tls", certs, "--listen", "127.0.0.1:0", "--max-boxes", "64", "-v")
		cmd.Env = append(os.Environ(), r.opts.ServerEnv...)
		stderr, err := cmd.StderrPipe()
		if err != nil {
			ns.stop()
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			ns.stop()
			return nil, err
		}
		ns.procs = append(ns.procs, cmd)
		addr := make(chan string, 1)
		go func() {
			sc := bufio.NewScanner(stderr)
			sent := false
			for sc.Scan() {
				line := sc.Text()
				if m := nodeAddrRe.FindStringSubmatch(line); m != nil && !sent {
					addr <- m[1]
					sent = true
				}
				r.log.Debug("kiln node", "node", i, "line", line)
			}
			close(addr)
		}()
		select {
		case a, ok := <-addr:
			if !ok {
				ns.stop()
				return nil, errors.New("a kiln node exited before it served (run with -v for its log)")
			}
			ns.addrs = append(ns.addrs, a)
		case <-time.After(time.Minute):
			ns.stop()
			return nil, errors.New("a kiln node did not serve within a minute")
		case <-ctx.Done():
			ns.stop()
			return nil, ctx.Err()
		}
	}
	return ns, nil
}

// frontArgs are the `kiln mcp` flags of a front of the first n nodes.
func (ns *nodeSet) frontArgs(n int) []string {
	return []string{"--cluster-tls", filepath.Join(ns.dir, "certs"), "--cluster-nodes", strings.Join(ns.addrs[:n], ",")}
}

func (ns *nodeSet) stop() {
	for _, c := range ns.procs {
		c.Process.Signal(os.Interrupt)
	}
	for _, c := range ns.procs {
		done := make(chan struct{})
		go func() { c.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			c.Process.Kill()
			<-done
		}
	}
	os.RemoveAll(ns.dir)
}

func (r *runner) nodeSteps() []step {
	if r.opts.Traits.Nodes == 0 {
		return nil
	}
	steps := []step{
		{"nodes-throughput", r.throughputByNodes},
		{"jail", r.alongsideJail},
	}
	for _, o := range r.opts.Alongside {
		steps = append(steps, step{o.Backend, func(ctx context.Context) error {
			return r.alongside(ctx, o.Backend, o.Traits, "the "+o.Backend+" backend")
		}})
	}
	return steps
}

// throughputByNodes measures the per-call throughput at the most clients
// with a front of one node, of two, … of all.
func (r *runner) throughputByNodes(ctx context.Context) error {
	if len(r.opts.Clients) == 0 || r.nodes == nil {
		return nil
	}
	clients := slices.Max(r.opts.Clients)
	for k := 1; k <= len(r.nodes.addrs); k++ {
		r.progress("measuring per-call throughput with %d clients through %d node%s for %s", clients, k, plural(k), r.opts.Duration)
		srv, err := r.startServerWith(ctx, "per-call", r.opts.Pool, r.nodes.frontArgs(k)...)
		if err != nil {
			return err
		}
		if err := r.warm(ctx, srv, "per-call"); err != nil {
			srv.close()
			return err
		}
		if err := sleep(ctx, r.opts.Settle); err != nil {
			srv.close()
			return err
		}
		w := r.cpuStart(srv)
		l := closedLoop(ctx, clients, r.opts.Duration, func() error {
			_, err := srv.call(ctx, "run_python", runPython(printCode, ""), printWant)
			return err
		})
		span := w.stop()
		srv.close()
		key := fmt.Sprintf("nodes-throughput-%d", k)
		r.add(l.measurement(key, fmt.Sprintf("per-call throughput, %d clients, %d node%s", clients, k, plural(k)), "calls"))
		if len(l.samples) > 0 {
			r.cpuRow(fmt.Sprintf("nodes-cpu-call-%d", k), fmt.Sprintf("CPU per per-call run, %d node%s", k, plural(k)), span, len(l.samples),
				"the front and its nodes (the bench's children) / calls")
		}
	}
	return nil
}
