package cli

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"

	"kiln/internal/audit"
	"kiln/internal/event"
	"kiln/internal/mcpserver"
	"kiln/internal/metrics"
	"kiln/internal/session"
)

// obsFlags are the flags of kiln mcp and kiln serve for the audit log and
// the metrics listener.
type obsFlags struct {
	auditLog    string
	auditMaxMiB int64
	auditKeep   int
	includeCode bool
	metricsAddr string
}

func (o *obsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&o.auditLog, "audit-log", "", "append an audit record (JSON lines: executions, egress attempts, session changes) to this file, created owner-only (default: none)")
	fs.Int64Var(&o.auditMaxMiB, "audit-max-size", audit.DefaultMaxBytes>>20, "rotate the audit log past this many MiB (0: never)")
	fs.IntVar(&o.auditKeep, "audit-keep", audit.DefaultKeep, "rotated audit logs kept (FILE.1 … FILE.N)")
	fs.BoolVar(&o.includeCode, "audit-include-code", false, "write each execution's code into its audit record (never its output); by default only its SHA-256 and size")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at /metrics, and /healthz and /readyz, on this address, e.g. 127.0.0.1:9464; off loopback only with a token (KILN_TOKEN, --token-file), which /metrics then requires (default: off)")
}

// observers are a server's audit log and metrics, and the metrics listener.
type observers struct {
	audit   *audit.Log
	metrics *metrics.Metrics
	warm    atomic.Bool
	srv     *http.Server
	addr    net.Addr // the metrics listener's
	log     *slog.Logger
}

// open opens the audit log and makes the metrics, as the flags ask.
func (o *obsFlags) open(backend string, log *slog.Logger) (*observers, error) {
	obs := &observers{log: log}
	if o.auditLog != "" {
		maxBytes := o.auditMaxMiB << 20
		if o.auditMaxMiB == 0 {
			maxBytes = -1
		}
		keep := o.auditKeep
		if keep == 0 {
			keep = -1
		}
		l, err := audit.Open(audit.Options{Path: o.auditLog, MaxBytes: maxBytes, Keep: keep, IncludeCode: o.includeCode, Logger: log})
		if err != nil {
			return nil, fmt.Errorf("--audit-log: %w", err)
		}
		obs.audit = l
		log.Info("audit log", "path", o.auditLog, "include_code", o.includeCode)
	}
	if o.metricsAddr != "" {
		obs.metrics = metrics.New(metrics.Options{Backend: backend, Version: mcpserver.Version, Logger: log})
	}
	return obs, nil
}

// observer is what the session manager and the egress gateway report to;
// nil when neither is on.
func (obs *observers) observer() event.Observer {
	if obs == nil {
		return nil
	}
	var a, m event.Observer
	if obs.audit != nil {
		a = obs.audit
	}
	if obs.metrics != nil {
		m = obs.metrics
	}
	return event.Multi(a, m)
}

// serve starts the metrics listener on addr, reading mgr's state. Off
// loopback it needs toks, the tokens of /mcp, and requires one of them.
func (obs *observers) serve(addr string, toks []mcpserver.Token, mgr *session.Manager) error {
	if obs.metrics == nil {
		return nil
	}
	obs.metrics.SetSource(mgr)
	ready := func() error { return metrics.Readiness(mgr.Stats(), obs.warm.Load()) }
	// The metrics show every principal's work, summed: off loopback they
	// are served as /mcp is, only with a token. /healthz and /readyz
	// say no more than /mcp's own /healthz, and stay open for probes.
	h := obs.metrics.Handler(ready)
	guarded, err := mcpserver.Guard(addr, toks, h)
	if err != nil {
		return fmt.Errorf("--metrics-addr %s: %w; listen on 127.0.0.1, or give kiln serve a token, which the metrics listener then requires", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/", guarded)
	mux.Handle("GET /healthz", h)
	mux.Handle("GET /readyz", h)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("--metrics-addr: listening on %s: %w", addr, err)
	}
	obs.addr = ln.Addr()
	obs.srv = metrics.Server(mux)
	go func() {
		if err := obs.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			obs.log.Error("metrics listener", "err", err)
		}
	}()
	obs.log.Info("serving metrics", "url", "http://"+ln.Addr().String()+"/metrics")
	return nil
}

// close stops the metrics listener and closes the audit log; call it
// after the session manager closed, so its last records are written.
func (obs *observers) close() {
	if obs == nil {
		return
	}
	if obs.srv != nil {
		obs.srv.Close()
	}
	if obs.audit != nil {
		if err := obs.audit.Close(); err != nil {
			obs.log.Warn("closing the audit log", "err", err)
		}
	}
}
