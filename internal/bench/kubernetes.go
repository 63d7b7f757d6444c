package bench

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"
)

// What `kiln bench --backend kubernetes` measures besides the common rows
// (where the session call is a round trip over the attach stream and every
// per-call run takes a Pod): a per-call run whose box is taken from the
// warm pool against one whose Pod is made for the call, the CPU per box
// and per session call machine-wide and of the control plane's
// components (kube-apiserver, etcd, kubelet, containerd, shims) net of an
// idle baseline taken in the same run, and, next to each kubernetes row,
// the same row of a local jail server measured in the same run.

// step is one measurement step of a run.
type step struct {
	key string
	fn  func(context.Context) error
}

// kubeGap is the pause between the pool-hit runs: long enough for the
// warm pool to make the Pod that replaces the one taken.
const kubeGap = 2 * time.Second

// jailPrefix starts the keys of the jail rows of a kubernetes run.
const jailPrefix = "jail:"

func (r *runner) kubernetesSteps() []step {
	if !r.opts.Traits.Cluster {
		return nil
	}
	return []step{
		{"k8s-create", r.k8sCreate},
		{"cpu-box", r.boxAndCallCPU},
		{"jail", r.alongsideJail},
	}
}

// k8sCreate measures per-call runs with the box from the warm pool and
// with its Pod made for the call. The session layer's own pool is off in
// both, so every call's box comes from the backend's Create.
func (r *runner) k8sCreate(ctx context.Context) error {
	n := max(r.opts.Iterations/5, 5)
	for _, c := range []struct {
		key, name string
		pool      int
		gap       time.Duration
	}{
		{"k8s-create-hit", "per-call run, Pod from the warm pool (hit)", 2, kubeGap},
		{"k8s-create-miss", "per-call run, Pod made for the call (miss)", 0, 0},
	} {
		if r.skipped(c.key) {
			continue
		}
		r.progress("measuring %d %s", n, c.name)
		srv, err := r.startServerWith(ctx, "per-call", 0, "--k8s-warm-pool", fmt.Sprint(c.pool))
		if err != nil {
			return err
		}
		err = r.warm(ctx, srv, "per-call")
		var samples []time.Duration
		for i := 0; i < n && err == nil; i++ {
			if err = sleep(ctx, max(c.gap, r.opts.Settle)); err != nil {
				break
			}
			var d time.Duration
			d, err = srv.call(ctx, "run_python", runPython(printCode, ""), printWant)
			samples = append(samples, d)
		}
		srv.close()
		if err != nil {
			return fmt.Errorf("%s: %w", c.key, err)
		}
		note := "--pool 0: box from the backend's Create; box create ≈ this − the session call"
		if c.pool > 0 {
			note = fmt.Sprintf("--k8s-warm-pool %d, calls %s apart; %s", c.pool, max(c.gap, r.opts.Settle), note)
		} else {
			note = "--k8s-warm-pool 0; " + note
		}
		r.latency(c.key, c.name, samples, note)
	}
	return nil
}

// boxAndCallCPU measures the CPU per box (a per-call run: create, call,
// delete) and per session call, machine-wide and, on kubernetes, of each
// control-plane component, each net of an idle baseline of the same
// length taken just before with the per-call server idle.
func (r *runner) boxAndCallCPU(ctx context.Context) error {
	k8s := r.opts.Traits.Cluster
	window := func() (*cpuWindow, *procSampler) {
		var s *procSampler
		if k8s {
			s = startProcSampler(k8sComponents)
		}
		return r.cpuStart(nil), s
	}
	end := func(w *cpuWindow, s *procSampler) (cpuSpan, componentCPU) {
		span := w.stop()
		if s == nil {
			return span, nil
		}
		return span, s.stop()
	}

	srv, err := r.startWarm(ctx, "per-call", r.opts.Pool)
	if err != nil {
		return err
	}
	defer func() { srv.close() }()
	if err := sleep(ctx, r.opts.Settle); err != nil {
		return err
	}
	if err := r.quiet(ctx); err != nil {
		return err
	}
	r.progress("measuring the idle machine's CPU for %s", r.opts.Duration)
	w, s := window()
	if err := sleep(ctx, r.opts.Duration); err != nil {
		return err
	}
	idle, idleComps := end(w, s)
	if idle.MachineErr != nil {
		return fmt.Errorf("reading machine-wide CPU time: %w", idle.MachineErr)
	}

	// row adds the machine-wide figure per operation, net of idle, and
	// on kubernetes the control plane's.
	row := func(key, name string, span cpuSpan, comps componentCPU, n int, what string) {
		if n == 0 || span.MachineErr != nil {
			return
		}
		scale := span.Elapsed.Seconds() / idle.Elapsed.Seconds()
		base := time.Duration(float64(idle.Machine) * scale)
		m := Measurement{Key: key, Name: name + ", machine-wide, net of idle", Unit: "ms CPU", N: n,
			P50: ms(span.Machine-base) / float64(n),
			Note: fmt.Sprintf("%s; %.0f ms busy in all over %s, %.0f ms of it the idle baseline",
				what, ms(span.Machine), span.Elapsed.Round(time.Millisecond), ms(base))}
		m.P99 = m.P50
		r.add(m)
		if comps == nil {
			return
		}
		net := ms(comps.total()-time.Duration(float64(idleComps.total())*scale)) / float64(n)
		r.add(Measurement{Key: "cp-" + strings.TrimPrefix(key, "cpu-"), Name: name + ", control plane, net of idle",
			Unit: "ms CPU", N: n, P50: net, P99: net,
			Note: "from /proc, per component, net of idle: " + comps.describe(n, idleComps, idle.Elapsed, span.Elapsed) +
				"; gross: " + comps.describe(n, nil, 0, 0) +
				fmt.Sprintf("; idle: %s ms over %s", num(ms(idleComps.total())), idle.Elapsed.Round(time.Millisecond))})
	}

	if !r.skipped("cpu-box") {
		const clients = 2
		r.progress("measuring the CPU per box: per-call runs from %d clients for %s", clients, r.opts.Duration)
		w, s := window()
		n, err := r.loop(ctx, srv, clients, "")
		span, comps := end(w, s)
		if err != nil {
			return err
		}
		row("cpu-box", "CPU per box (per-call run)", span, comps, n, fmt.Sprintf("%d clients, pool %d", clients, r.opts.Pool))
	}
	srv.close()

	if r.skipped("cpu-session-call") {
		return nil
	}
	srv, err = r.startWarm(ctx, "session", r.opts.Pool)
	if err != nil {
		return err
	}
	if _, err := srv.call(ctx, "run_python", runPython(printCode, "cpu"), printWant); err != nil {
		return err
	}
	r.progress("measuring the CPU per session call for %s", r.opts.Duration)
	w, s = window()
	n, err := r.loop(ctx, srv, 1, "cpu")
	span, comps := end(w, s)
	if err != nil {
		return err
	}
	row("cpu-session-call", "CPU per session call", span, comps, n, "one session, back to back")
	return nil
}

// loop calls print(2+2) from clients concurrent callers for Duration, in
// session ("" for per-call), and returns how many calls succeeded.
func (r *runner) loop(ctx context.Context, srv *server, clients int, session string) (int, error) {
	var (
		mu      sync.Mutex
		n       int
		firstEr error
		wg      sync.WaitGroup
	)
	deadline := time.Now().Add(r.opts.Duration)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) && ctx.Err() == nil {
				_, err := srv.call(ctx, "run_python", runPython(printCode, session), printWant)
				mu.Lock()
				if err != nil && firstEr == nil {
					firstEr = err
				} else if err == nil {
					n++
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	return n, firstEr
}

// alongsideJail measures the same rows with a local jail server, in the
// same run; their keys start with jailPrefix and pairJail places each
// after its kubernetes row.
func (r *runner) alongsideJail(ctx context.Context) error {
	return r.alongside(ctx, "jail", r.opts.Jail, "a local jail server")
}

// alongside measures the session, per-call, throughput and CPU rows with
// servers of another backend, in the same run (and, for the kubernetes
// backend, its warm-pool hit and miss); their keys start with the
// backend's name and a colon, and pairJail places each after the row of
// the same key.
func (r *runner) alongside(ctx context.Context, backend string, traits Traits, what string) error {
	o := r.opts
	o.Backend, o.Traits = backend, traits
	j := &runner{opts: o, log: r.log, cpu: r.cpu, rep: &Report{Backend: backend, CPUs: r.rep.CPUs}}
	r.progress("measuring the same with %s", what)
	steps := []step{{"session", j.session}, {"percall", j.perCall}, {"throughput", j.throughput}, {"cpu-box", j.boxAndCallCPU}}
	if traits.Cluster {
		steps = append([]step{{"k8s-create", j.k8sCreate}}, steps...)
	}
	var errs []string
	for _, s := range steps {
		if j.skipped(s.key) {
			continue
		}
		if err := s.fn(ctx); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			errs = append(errs, s.key+": "+err.Error())
			j.add(Measurement{Key: s.key, Name: s.key, Err: err.Error()})
		}
	}
	for _, m := range j.rep.Measurements {
		m.Key = backend + ":" + m.Key
		m.Name = "  " + backend + ": " + m.Name
		r.add(m)
	}
	if len(errs) > 0 {
		return fmt.Errorf("the %s alongside: %s", backend, strings.Join(errs, "; "))
	}
	return nil
}

// pairJail orders a run's rows so that the rows of the backends measured
// alongside (keys "jail:…", "kubernetes:…") follow the row of the same key,
// in the order they were measured; those with no such row come last.
func (r *runner) pairJail() {
	ms := r.rep.Measurements
	own := map[string]bool{}
	for _, m := range ms {
		if !r.alongsideKey(m.Key) {
			own[m.Key] = true
		}
	}
	twins := map[string][]Measurement{}
	var rest []Measurement
	for _, m := range ms {
		if !r.alongsideKey(m.Key) {
			continue
		}
		_, k, _ := strings.Cut(m.Key, ":")
		if own[k] {
			twins[k] = append(twins[k], m)
		} else {
			rest = append(rest, m)
		}
	}
	out := make([]Measurement, 0, len(ms))
	for _, m := range ms {
		if !r.alongsideKey(m.Key) {
			out = append(out, m)
			out = append(out, twins[m.Key]...)
			delete(twins, m.Key)
		}
	}
	r.rep.Measurements = append(out, rest...)
}

// alongsideKey says whether key is a row of a backend measured alongside.
func (r *runner) alongsideKey(key string) bool {
	if strings.HasPrefix(key, jailPrefix) {
		return true
	}
	for _, o := range r.opts.Alongside {
		if strings.HasPrefix(key, o.Backend+":") {
			return true
		}
	}
	return false
}
