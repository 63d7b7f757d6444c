// Package metrics exposes kiln's Prometheus metrics, with /healthz and
// /readyz, on a listener of its own (kiln --metrics-addr), apart from the
// MCP endpoint. It keeps its own registry, never the client library's
// global one, so nothing else linked into kiln can add to what it shows.
//
// Counters and histograms move on events (event.Observer): executions,
// box creations, pool misses, egress verdicts, session changes. Gauges
// that describe a state (live sessions and boxes, the pool, the memory of
// boxes) are read from the session manager when Prometheus scrapes.
package metrics

import (
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"kiln/internal/event"
	"kiln/internal/session"
)

// Source is what the scrape-time gauges read: the session manager.
type Source interface {
	Stats() session.Stats
	BoxMemory() []int64
}

// Options configure Metrics.
type Options struct {
	Backend string // the server's backend, the "backend" label of its gauges
	Version string // kiln's version, for kiln_build_info
	Logger  *slog.Logger
}

// Buckets of the histograms, in seconds and bytes.
var (
	callBuckets   = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}
	createBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}
	memoryBuckets = prometheus.ExponentialBuckets(4<<20, 2, 10) // 4 MiB … 2 GiB
)

// Metrics holds kiln's metrics. It implements event.Observer.
type Metrics struct {
	opts Options
	reg  *prometheus.Registry
	src  *sourceCollector

	executions   *prometheus.CounterVec
	callSeconds  *prometheus.HistogramVec
	limitsHit    *prometheus.CounterVec
	createSecs   *prometheus.HistogramVec
	createErrors *prometheus.CounterVec
	poolMisses   *prometheus.CounterVec
	egress       *prometheus.CounterVec
	sessions     *prometheus.CounterVec
}

var _ event.Observer = (*Metrics)(nil)

// New makes kiln's metrics on a registry of their own, with the Go
// runtime's and the process's.
func New(opts Options) *Metrics {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	m := &Metrics{
		opts: opts,
		reg:  prometheus.NewRegistry(),
		executions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kiln_executions_total",
			Help: "run_python and run_shell calls, by backend and result class (ok, error, timeout, oom, killed, cancelled, busy, fault).",
		}, []string{"backend", "result"}),
		callSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kiln_execution_duration_seconds",
			Help:    "Wall time of run_python and run_shell calls that reached a sandbox.",
			Buckets: callBuckets,
		}, []string{"backend"}),
		limitsHit: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kiln_limits_hit_total",
			Help: "Calls that hit a sandbox limit, by limit (memory, pids, disk, time).",
		}, []string{"backend", "limit"}),
		createSecs: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kiln_box_create_duration_seconds",
			Help:    "Time to create a sandbox, for the pool or for a call.",
			Buckets: createBuckets,
		}, []string{"backend"}),
		createErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kiln_box_create_errors_total",
			Help: "Sandbox creations that failed.",
		}, []string{"backend"}),
		poolMisses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kiln_pool_misses_total",
			Help: "Calls that found no ready sandbox in the pool (only when the pool is on).",
		}, []string{"backend"}),
		egress: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kiln_egress_attempts_total",
			Help: "Network attempts of sandboxes through the egress gateway, by way (dns, proxy, connect, http, tls) and verdict (allow, refuse, error).",
		}, []string{"via", "verdict"}),
		sessions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kiln_session_events_total",
			Help: "Changes in named sessions' lives: create, reset, expire, close, snapshot, restore.",
		}, []string{"backend", "op"}),
	}
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "kiln_build_info",
		Help:        "Always 1; its labels name kiln's version and the server's backend.",
		ConstLabels: prometheus.Labels{"version": opts.Version, "backend": opts.Backend},
	})
	info.Set(1)
	m.reg.MustRegister(info, m.executions, m.callSeconds, m.limitsHit, m.createSecs, m.createErrors,
		m.poolMisses, m.egress, m.sessions,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// The result classes and verdicts show from the start, at zero, so a
	// dashboard's rate() has a series before the first call.
	for _, r := range []string{event.ResultOK, event.ResultError, event.ResultTimeout, event.ResultOOM, event.ResultKilled} {
		m.executions.WithLabelValues(opts.Backend, r)
	}
	m.poolMisses.WithLabelValues(opts.Backend)
	m.createErrors.WithLabelValues(opts.Backend)
	return m
}

// Registry is the metrics' own registry.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// SetSource registers the gauges read from src at each scrape. Call it
// once, when the session manager exists.
func (m *Metrics) SetSource(src Source) {
	m.src = newSourceCollector(m.opts.Backend, src)
	m.reg.MustRegister(m.src)
}

// Observe counts one event.
func (m *Metrics) Observe(e event.Event) {
	switch e := e.(type) {
	case event.Exec:
		m.executions.WithLabelValues(e.Backend, e.Result).Inc()
		if e.Box != "" {
			m.callSeconds.WithLabelValues(e.Backend).Observe(e.Duration.Seconds())
		}
		for _, l := range e.LimitsHit {
			m.limitsHit.WithLabelValues(e.Backend, l).Inc()
		}
	case event.Box:
		switch {
		case e.PoolMiss:
			m.poolMisses.WithLabelValues(e.Backend).Inc()
		case e.Err:
			m.createErrors.WithLabelValues(e.Backend).Inc()
		default:
			m.createSecs.WithLabelValues(e.Backend).Observe(e.Duration.Seconds())
		}
	case event.Egress:
		m.egress.WithLabelValues(e.Via, e.Verdict).Inc()
	case event.Session:
		m.sessions.WithLabelValues(e.Backend, e.Op).Inc()
	}
}

// sourceCollector reads the session manager's state at scrape time.
type sourceCollector struct {
	backend string
	src     Source

	sessions, boxes, poolReady, poolSize, memTotal, mem *prometheus.Desc
}

func newSourceCollector(backend string, src Source) *sourceCollector {
	l := []string{"backend"}
	return &sourceCollector{
		backend:   backend,
		src:       src,
		sessions:  prometheus.NewDesc("kiln_sessions_live", "Live named sessions.", l, nil),
		boxes:     prometheus.NewDesc("kiln_boxes_live", "Live sandboxes: sessions', per-call, the pool's and those being destroyed.", l, nil),
		poolReady: prometheus.NewDesc("kiln_pool_ready_boxes", "Sandboxes ready in the pool.", l, nil),
		poolSize:  prometheus.NewDesc("kiln_pool_target_boxes", "Sandboxes the pool is asked to keep ready (--pool).", l, nil),
		memTotal:  prometheus.NewDesc("kiln_box_memory_bytes_total", "Memory charged to the cgroups of the sandboxes running calls (sessions' and per-call), summed; backends that report it only.", l, nil),
		mem:       prometheus.NewDesc("kiln_box_memory_bytes", "Memory charged to each sandbox running calls, read at scrape time; backends that report it only.", l, nil),
	}
}

func (c *sourceCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.sessions, c.boxes, c.poolReady, c.poolSize, c.memTotal, c.mem} {
		ch <- d
	}
}

func (c *sourceCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.src.Stats()
	gauge := func(d *prometheus.Desc, v int) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), c.backend)
	}
	gauge(c.sessions, st.Sessions)
	gauge(c.boxes, st.Boxes)
	gauge(c.poolReady, st.PoolReady)
	gauge(c.poolSize, st.PoolSize)
	mem := c.src.BoxMemory()
	var sum float64
	counts := make(map[float64]uint64, len(memoryBuckets))
	for _, n := range mem {
		v := float64(n)
		sum += v
		for _, b := range memoryBuckets {
			if v <= b {
				counts[b]++
			}
		}
	}
	ch <- prometheus.MustNewConstMetric(c.memTotal, prometheus.GaugeValue, sum, c.backend)
	ch <- prometheus.MustNewConstHistogram(c.mem, uint64(len(mem)), sum, counts, c.backend)
}

// Readiness is kiln's answer to /readyz, from the manager's state and
// whether the backend finished its warm-up (backends without one are warm
// from the start):
//   - shutting down: not ready;
//   - with a pool (--pool > 0): ready while the pool holds a box, so a
//     balancer sends calls where one starts without waiting;
//   - without a pool: ready once the backend is warm (the jail's zygote
//     or gVisor's template started), when a call costs a box creation
//     and nothing more.
func Readiness(st session.Stats, warm bool) error {
	switch {
	case st.Closed:
		return errors.New("shutting down")
	case st.PoolSize > 0 && st.PoolReady == 0:
		return errors.New("no sandbox ready in the pool")
	case st.PoolSize == 0 && !warm:
		return errors.New("the backend is warming up")
	}
	return nil
}

// Handler serves /metrics, /healthz (200 while the process serves) and
// /readyz (200 when ready() returns nil, else 503 with its reason).
func (m *Metrics) Handler(ready func() error) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		ErrorLog:            slog.NewLogLogger(m.opts.Logger.Handler(), slog.LevelWarn),
		Registry:            m.reg,
		MaxRequestsInFlight: 4,
		Timeout:             10 * time.Second,
	}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if ready != nil {
			if err := ready(); err != nil {
				w.WriteHeader(http.StatusServiceUnavailable)
				w.Write([]byte("not ready: " + err.Error() + "\n"))
				return
			}
		}
		w.Write([]byte("ready\n"))
	})
	return mux
}

// Server returns an HTTP server for h with bounded timeouts.
func Server(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    16 << 10,
	}
}
