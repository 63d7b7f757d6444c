package metrics

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"kiln/internal/event"
	"kiln/internal/session"
)

type fakeSource struct {
	st  session.Stats
	mem []int64
}

func (f *fakeSource) Stats() session.Stats { return f.st }
func (f *fakeSource) BoxMemory() []int64   { return f.mem }

func TestReadiness(t *testing.T) {
	for _, tc := range []struct {
		name  string
		st    session.Stats
		warm  bool
		ready bool
	}{
		{"pool holds a box", session.Stats{PoolSize: 2, PoolReady: 1}, false, true},
		{"pool empty", session.Stats{PoolSize: 2, PoolReady: 0}, true, false},
		{"no pool, warm", session.Stats{}, true, true},
		{"no pool, cold", session.Stats{}, false, false},
		{"shutting down", session.Stats{PoolSize: 1, PoolReady: 1, Closed: true}, true, false},
	} {
		if err := Readiness(tc.st, tc.warm); (err == nil) != tc.ready {
			t.Errorf("%s: Readiness = %v, want ready %v", tc.name, err, tc.ready)
		}
	}
}

func TestObserveAndScrape(t *testing.T) {
	m := New(Options{Backend: "jail", Version: "1.2.3"})
	src := &fakeSource{st: session.Stats{Sessions: 3, Boxes: 5, PoolReady: 1, PoolSize: 2}, mem: []int64{10 << 20, 30 << 20}}
	m.SetSource(src)
	m.Observe(event.Exec{Backend: "jail", Box: "b", Result: event.ResultOOM, Duration: time.Second, LimitsHit: []string{event.LimitMemory}})
	m.Observe(event.Exec{Backend: "jail", Result: event.ResultBusy}) // no box: no duration
	m.Observe(event.Box{Backend: "jail", Duration: time.Millisecond})
	m.Observe(event.Box{Backend: "jail", Err: true})
	m.Observe(event.Box{Backend: "jail", PoolMiss: true})
	m.Observe(event.Egress{Via: "proxy", Verdict: event.VerdictAllow})
	m.Observe(event.Session{Backend: "jail", Op: event.SessionExpire})

	for _, c := range []struct {
		c    prometheus.Collector
		want float64
	}{
		{m.executions.WithLabelValues("jail", "oom"), 1},
		{m.executions.WithLabelValues("jail", "busy"), 1},
		{m.executions.WithLabelValues("jail", "ok"), 0},
		{m.limitsHit.WithLabelValues("jail", "memory"), 1},
		{m.createErrors.WithLabelValues("jail"), 1},
		{m.poolMisses.WithLabelValues("jail"), 1},
		{m.egress.WithLabelValues("proxy", "allow"), 1},
		{m.sessions.WithLabelValues("jail", "expire"), 1},
	} {
		if got := testutil.ToFloat64(c.c); got != c.want {
			t.Errorf("%v = %v, want %v", c.c, got, c.want)
		}
	}
	if n := testutil.CollectAndCount(m.callSeconds); n != 1 {
		t.Errorf("%d call duration series, want 1", n)
	}

	srv := httptest.NewServer(m.Handler(func() error { return Readiness(src.Stats(), true) }))
	defer srv.Close()
	body := fetch(t, srv.URL+"/metrics", http.StatusOK)
	for _, want := range []string{
		`kiln_build_info{backend="jail",version="1.2.3"} 1`,
		`kiln_sessions_live{backend="jail"} 3`,
		`kiln_boxes_live{backend="jail"} 5`,
		`kiln_pool_ready_boxes{backend="jail"} 1`,
		`kiln_pool_target_boxes{backend="jail"} 2`,
		`kiln_box_memory_bytes_total{backend="jail"} 4.194304e+07`,
		`kiln_box_memory_bytes_count{backend="jail"} 2`,
		`kiln_box_memory_bytes_bucket{backend="jail",le="1.6777216e+07"} 1`,
		`kiln_box_memory_bytes_bucket{backend="jail",le="3.3554432e+07"} 2`,
		`kiln_execution_duration_seconds_count{backend="jail"} 1`,
		"go_goroutines ",
		"process_open_fds ",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	fetch(t, srv.URL+"/healthz", http.StatusOK)
	fetch(t, srv.URL+"/readyz", http.StatusOK)
	src.st.PoolReady = 0
	if body := fetch(t, srv.URL+"/readyz", http.StatusServiceUnavailable); !strings.Contains(body, "no sandbox ready in the pool") {
		t.Errorf("/readyz with an empty pool: %q", body)
	}

	// The metrics are kiln's own: the library's global registry holds none.
	fams, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if strings.HasPrefix(f.GetName(), "kiln_") {
			t.Errorf("%s is in the global registry", f.GetName())
		}
	}
}

func fetch(t *testing.T, url string, status int) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		t.Errorf("%s: %d, want %d\n%s", url, resp.StatusCode, status, b)
	}
	return string(b)
}
