package bench

import (
	"context"
	"debug/buildinfo"
	"fmt"
	"strings"
	"time"
)

// The cost of each of the jail's hardening measures, measured by turning
// it off alone. Seccomp, Landlock and the per-box cgroup can only be
// turned off in a kiln built with the build tag BenchKnobsTag, through
// the environment variable WeakenEnv of its `kiln mcp`; a normal build
// has no code that reads it (internal/sandbox/jail/benchknobs*.go).
// Zygote rotation is turned off with its ordinary flags.
const (
	BenchKnobsTag = "kiln_benchknobs"
	WeakenEnv     = "KILN_BENCH_WEAKEN"
)

type hardeningVariant struct {
	key, name string
	weaken    string   // WeakenEnv's value; "" for none
	args      []string // added to the server's flags
}

var hardeningVariants = []hardeningVariant{
	{key: "all-on", name: "every measure on"},
	{key: "seccomp-off", name: "seccomp filter off", weaken: "seccomp"},
	{key: "landlock-off", name: "Landlock off", weaken: "landlock"},
	{key: "cgroups-off", name: "per-box cgroup off", weaken: "cgroups"},
	{key: "rotation-off", name: "zygote rotation off", args: []string{"--zygote-max-boxes", "0", "--zygote-max-age", "0"}},
	{key: "all-off", name: "all four off", weaken: "seccomp,landlock,cgroups", args: []string{"--zygote-max-boxes", "0", "--zygote-max-age", "0"}},
}

// hasBenchKnobs says whether the kiln binary at path was built with
// BenchKnobsTag.
func hasBenchKnobs(path string) (bool, error) {
	info, err := buildinfo.ReadFile(path)
	if err != nil {
		return false, fmt.Errorf("reading build info of %s: %w", path, err)
	}
	for _, s := range info.Settings {
		if s.Key == "-tags" && strings.Contains(","+s.Value+",", ","+BenchKnobsTag+",") {
			return true, nil
		}
	}
	return false, nil
}

// hardening runs, for each variant, per-call print(2+2) on a warm pool
// (p50) and back to back (CPU per call), on a backend that
// has these measures (Traits.Hardening: the jail).
func (r *runner) hardening(ctx context.Context) error {
	if !r.opts.Traits.Hardening {
		return nil
	}
	knobs, err := hasBenchKnobs(r.opts.Kiln)
	if err != nil {
		return err
	}
	for _, v := range hardeningVariants {
		key := "hardening-" + v.key
		if r.skipped(key) {
			continue
		}
		if v.weaken != "" && !knobs {
			r.add(Measurement{Key: key, Name: "jail per-call, " + v.name,
				Err: fmt.Sprintf("not measured: %s was not built with -tags %s (make bench-kiln)", r.opts.Kiln, BenchKnobsTag)})
			continue
		}
		r.progress("measuring the jail with %s", v.name)
		if err := r.hardeningVariant(ctx, key, v); err != nil {
			if ctx.Err() != nil {
				return err
			}
			r.add(Measurement{Key: key, Name: "jail per-call, " + v.name, Err: err.Error()})
		}
	}
	return nil
}

func (r *runner) hardeningVariant(ctx context.Context, key string, v hardeningVariant) error {
	saved := r.opts
	defer func() { r.opts = saved }()
	r.opts.ServerArgs = append(append([]string(nil), saved.ServerArgs...), v.args...)
	r.opts.ServerEnv = append([]string(nil), saved.ServerEnv...)
	if v.weaken != "" {
		r.opts.ServerEnv = append(r.opts.ServerEnv, WeakenEnv+"="+v.weaken)
	}
	srv, err := r.startWarm(ctx, "per-call", r.opts.Pool)
	if err != nil {
		return err
	}
	defer srv.close()
	if err := sleep(ctx, r.opts.Settle); err != nil {
		return err
	}
	var warm []time.Duration
	for range r.opts.Iterations {
		if err := sleep(ctx, r.opts.Gap); err != nil {
			return err
		}
		d, err := srv.call(ctx, "run_python", runPython(printCode, ""), printWant)
		if err != nil {
			return err
		}
		warm = append(warm, d)
	}
	if err := sleep(ctx, r.opts.Settle); err != nil {
		return err
	}
	w := r.cpuStart(srv)
	var b2b []time.Duration
	for range r.opts.Iterations {
		d, err := srv.call(ctx, "run_python", runPython(printCode, ""), printWant)
		if err != nil {
			return err
		}
		b2b = append(b2b, d)
	}
	span := w.stop()
	how := "normal build"
	if v.weaken != "" {
		how = WeakenEnv + "=" + v.weaken
	}
	if len(v.args) > 0 {
		how += ", " + strings.Join(v.args, " ")
	}
	r.latency(key, "jail per-call, "+v.name, warm, fmt.Sprintf("warm pool %d, calls %s apart; %s", r.opts.Pool, r.opts.Gap, how))
	b50, _ := percentiles(b2b)
	r.cpuRow(key+"-cpu", "  CPU per run, "+v.name, span, len(b2b),
		fmt.Sprintf("%d calls back to back (p50 %.1f ms), the pool refilling (±%d boxes at the ends)", len(b2b), b50, r.opts.Pool))
	return nil
}
