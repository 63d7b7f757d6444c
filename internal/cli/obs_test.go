package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/sandbox/sandboxtest"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

func resultText(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if t, ok := c.(*mcp.TextContent); ok {
			b.WriteString(t.Text)
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// startObserved starts kiln's stack as kiln mcp does, from flags.
func startObserved(t *testing.T, args ...string) *stack {
	t.Helper()
	fs := flag.NewFlagSet("kiln mcp", flag.ContinueOnError)
	var c common
	c.register(fs)
	c.obs.register(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st, err := c.start(ctx, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// scrape reads /metrics into families by name.
func scrape(t *testing.T, base string) map[string]*dto.MetricFamily {
	t.Helper()
	code, body := get(t, base+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d\n%s", code, body)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parsing /metrics: %v\n%s", err, body)
	}
	return fams
}

// value is the value of the series of family name whose labels include
// want; -1 if there is none.
func value(fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	f := fams[name]
	if f == nil {
		return -1
	}
	for _, m := range f.GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		match := true
		for k, v := range want {
			if labels[k] != v {
				match = false
			}
		}
		if !match {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.GetCounter().GetValue()
		case m.Gauge != nil:
			return m.GetGauge().GetValue()
		case m.Histogram != nil:
			return float64(m.GetHistogram().GetSampleCount())
		}
	}
	return -1
}

// TestObservedJailCall runs real calls on the jail through kiln's MCP
// server with --metrics-addr and --audit-log, one of them trying a name
// the egress policy refuses, then scrapes the metrics listener and reads
// the audit log: the counters moved, the records are there, and the
// secret the code printed is in neither.
func TestObservedJailCall(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the jail with an egress gateway needs root (user namespaces with a uid range, cgroups, network namespaces)")
	}
	agent := sandboxtest.BuildAgent(t)
	auditPath := filepath.Join(t.TempDir(), "audit.log")
	st := startObserved(t, "--agent", agent, "--zygote=false", "--preload", "", "--pool", "1",
		"--allow-net", "allowed.example", "--metrics-addr", "127.0.0.1:0", "--audit-log", auditPath)
	base := "http://" + st.obs.addr.String()

	if code, body := get(t, base+"/healthz"); code != http.StatusOK {
		t.Errorf("/healthz: %d %s", code, body)
	}
	// Ready once the pool holds its box.
	deadline := time.Now().Add(60 * time.Second)
	for {
		code, body := get(t, base+"/readyz")
		if code == http.StatusOK {
			break
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "no sandbox ready in the pool") {
			t.Fatalf("/readyz before the pool filled: %d %s", code, body)
		}
		if time.Now().After(deadline) {
			t.Fatal("/readyz never became ready")
		}
		time.Sleep(50 * time.Millisecond)
	}
	before := scrape(t, base)
	if v := value(before, "kiln_executions_total", map[string]string{"backend": "jail", "result": "ok"}); v != 0 {
		t.Fatalf("kiln_executions_total{result=ok} = %v before any call, want 0", v)
	}

	const secret = "OBSERVED-SECRET-31337"
	ctx := context.Background()
	code := "import socket\ns = 'OBSERVED-' + 'SECRET-31337'\nprint(s)\ntry:\n    socket.getaddrinfo('refused.example', 80)\nexcept OSError as e:\n    print('refused', e)\n"
	res, err := callInMemory(ctx, st.srv, "run_python", map[string]any{"code": code})
	if err != nil {
		t.Fatal(err)
	}
	if res.IsError || !strings.Contains(resultText(res), secret) {
		t.Fatalf("the call: %+v", resultText(res))
	}
	if res, err = callInMemory(ctx, st.srv, "run_python", map[string]any{"code": "1/0"}); err != nil || !res.IsError {
		t.Fatalf("a failing call: %v %+v", err, res)
	}

	after := scrape(t, base)
	for _, c := range []struct {
		name   string
		labels map[string]string
		min    float64
	}{
		{"kiln_executions_total", map[string]string{"backend": "jail", "result": "ok"}, 1},
		{"kiln_executions_total", map[string]string{"backend": "jail", "result": "error"}, 1},
		{"kiln_execution_duration_seconds", map[string]string{"backend": "jail"}, 2},
		{"kiln_box_create_duration_seconds", map[string]string{"backend": "jail"}, 1},
		{"kiln_egress_attempts_total", map[string]string{"via": "dns", "verdict": "refuse"}, 1},
		{"kiln_session_events_total", map[string]string{"backend": "jail", "op": "create"}, 1},
		{"kiln_sessions_live", map[string]string{"backend": "jail"}, 1},
		{"kiln_boxes_live", map[string]string{"backend": "jail"}, 1},
		{"kiln_pool_target_boxes", map[string]string{"backend": "jail"}, 1},
		{"kiln_box_memory_bytes", map[string]string{"backend": "jail"}, 1},
		{"kiln_box_memory_bytes_total", map[string]string{"backend": "jail"}, 1 << 20},
	} {
		if v := value(after, c.name, c.labels); v < c.min {
			t.Errorf("%s%v = %v after the calls, want at least %v", c.name, c.labels, v, c.min)
		}
	}
	if v := value(after, "kiln_executions_total", map[string]string{"backend": "jail", "result": "ok"}); v != 1 {
		t.Errorf("kiln_executions_total{result=ok} = %v after one successful call, want 1", v)
	}

	st.close()
	raw, err := os.ReadFile(auditPath)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(raw), secret) {
		t.Errorf("the audit log holds the secret the code printed:\n%s", raw)
	}
	var kinds []string
	sc := bufio.NewScanner(strings.NewReader(string(raw)))
	for sc.Scan() {
		var r map[string]any
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("audit line %q: %v", sc.Text(), err)
		}
		k, _ := r["type"].(string)
		for _, f := range []string{"op", "result", "verdict"} {
			if v, ok := r[f].(string); ok {
				k += ":" + v
			}
		}
		kinds = append(kinds, k)
	}
	for _, want := range []string{"session:create", "egress:refuse", "exec:ok", "exec:error", "session:close"} {
		if !strings.Contains(strings.Join(kinds, " "), want) {
			t.Errorf("audit log lacks a %s record: %v", want, kinds)
		}
	}
}

// TestMetricsListenerRule: the metrics listener obeys /mcp's rule. On a
// non-loopback address without tokens it is refused, naming the flag and
// the fix; with tokens it serves only requests that bear one; on loopback
// it serves without a token, as before.
func TestMetricsListenerRule(t *testing.T) {
	b := sessiontest.New(t, nil)
	mgr := session.NewManager(session.Options{Backend: b, Mode: session.ModePerCall})
	t.Cleanup(mgr.Close)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	toks := []mcpserver.Token{{Principal: "ops", Secret: "metrics-token-0123456789"}}
	start := func(addr string, toks []mcpserver.Token) (*observers, error) {
		t.Helper()
		o := obsFlags{metricsAddr: addr}
		obs, err := o.open(b.Name(), log)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(obs.close)
		return obs, obs.serve(addr, toks, mgr)
	}

	if _, err := start("0.0.0.0:0", nil); !errors.Is(err, mcpserver.ErrNoToken) || !strings.Contains(err.Error(), "--metrics-addr") {
		t.Errorf("--metrics-addr 0.0.0.0:0 without tokens: err = %v, want ErrNoToken naming --metrics-addr", err)
	}

	obs, err := start("0.0.0.0:0", toks)
	if err != nil {
		t.Fatalf("--metrics-addr 0.0.0.0:0 with a token: %v", err)
	}
	_, port, _ := net.SplitHostPort(obs.addr.String())
	url := "http://127.0.0.1:" + port
	if code, _ := get(t, url+"/healthz"); code != http.StatusOK {
		t.Errorf("GET /healthz on 0.0.0.0 without a token: %d, want 200 (probes need no token, as /mcp's /healthz)", code)
	}
	for _, path := range []string{"/metrics", "/metrics/", "/other"} {
		if code, _ := get(t, url+path); code != http.StatusUnauthorized {
			t.Errorf("GET %s on 0.0.0.0 without a token: %d, want 401", path, code)
		}
		req, _ := http.NewRequest("GET", url+path, nil)
		req.Header.Set("Authorization", "Bearer wrong-token-0123456789")
		if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("GET %s with a wrong token: %v %v, want 401", path, resp, err)
		} else {
			resp.Body.Close()
		}
	}
	req, _ := http.NewRequest("GET", url+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+toks[0].Secret)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET /metrics with the token: %d, want 200", resp.StatusCode)
	}

	lo, err := start("127.0.0.1:0", nil)
	if err != nil {
		t.Fatalf("--metrics-addr 127.0.0.1:0: %v", err)
	}
	if code, _ := get(t, "http://"+lo.addr.String()+"/metrics"); code != http.StatusOK {
		t.Errorf("GET /metrics on loopback without a token: %d, want 200", code)
	}
}
