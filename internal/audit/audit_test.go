package audit_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"kiln/internal/audit"
	"kiln/internal/config"
	"kiln/internal/event"
	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

func open(t *testing.T, opts audit.Options) *audit.Log {
	t.Helper()
	if opts.Path == "" {
		opts.Path = filepath.Join(t.TempDir(), "audit.log")
	}
	l, err := audit.Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// records reads a log file: every line must be one JSON object.
func records(t *testing.T, path string) []map[string]any {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []map[string]any
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r map[string]any
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("%s: line %q is not a JSON object: %v", path, sc.Text(), err)
		}
		out = append(out, r)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm()
}

// TestRecords checks each record type field by field: executions carry
// the code's hash and size, never the code unless asked.
func TestRecords(t *testing.T) {
	code := "print('hello')"
	sum := sha256.Sum256([]byte(code))
	at := time.Date(2026, 11, 30, 21, 0, 0, 5000, time.UTC)
	events := []event.Event{
		event.Exec{Time: at, Principal: "alice", Session: "s1", Box: "b1", Backend: "jail", Language: "python",
			Code: code, Duration: 1500 * time.Microsecond, Result: event.ResultTimeout, LimitsHit: []string{event.LimitTime},
			StdoutBytes: 10, StderrBytes: 2, Restarted: true},
		event.Egress{Time: at, Box: "b1", Via: "dns", Name: "evil.example", Verdict: event.VerdictRefuse, Reason: "not in the allowlist"},
		event.Session{Time: at, Op: event.SessionCreate, Principal: "alice", Session: "s1", Backend: "jail"},
		event.Box{Time: at, Backend: "jail", Duration: time.Millisecond}, // metrics only
	}
	ts := "2026-11-30T21:00:00.000005Z"
	exec := map[string]any{
		"time": ts, "type": "exec", "principal": "alice", "session": "s1", "box": "b1", "backend": "jail",
		"language": "python", "code_sha256": hex.EncodeToString(sum[:]), "code_bytes": float64(len(code)),
		"duration_ms": 1.5, "result": "timeout", "limits_hit": []any{"time"}, "stdout_bytes": float64(10),
		"stderr_bytes": float64(2), "restarted": true,
	}
	want := []map[string]any{
		exec,
		{"time": ts, "type": "egress", "box": "b1", "via": "dns", "name": "evil.example", "verdict": "refuse", "reason": "not in the allowlist"},
		{"time": ts, "type": "session", "op": "create", "principal": "alice", "session": "s1", "backend": "jail"},
	}
	for _, include := range []bool{false, true} {
		path := filepath.Join(t.TempDir(), "audit.log")
		l := open(t, audit.Options{Path: path, IncludeCode: include})
		for _, e := range events {
			l.Observe(e)
		}
		l.Close()
		l.Observe(events[0]) // after Close: dropped, no panic
		if include {
			exec["code"] = code
		}
		if diff := cmp.Diff(want, records(t, path)); diff != "" {
			t.Errorf("IncludeCode=%v: records (-want +got):\n%s", include, diff)
		}
		if m := mode(t, path); m != 0o600 {
			t.Errorf("log mode %v, want 0600", m)
		}
	}
}

// TestOwnerOnly: an existing log is made owner-only, and a symbolic link
// or a directory at the path is refused.
func TestOwnerOnly(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "audit.log")
	if err := os.WriteFile(path, []byte("{}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	open(t, audit.Options{Path: path})
	if m := mode(t, path); m != 0o600 {
		t.Errorf("an existing 0644 log is %v after Open, want 0600", m)
	}
	target := filepath.Join(dir, "elsewhere")
	if err := os.WriteFile(target, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.log")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if _, err := audit.Open(audit.Options{Path: link}); err == nil {
		t.Error("Open followed a symbolic link")
	}
	if _, err := audit.Open(audit.Options{Path: dir}); err == nil {
		t.Error("Open accepted a directory")
	}
}

// TestRotation writes past the size bound many times: the log rotates to
// .1 and .2, no file grows past the bound, nothing past Keep survives,
// and every line of every file is a whole record.
func TestRotation(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	const max = 1000
	l := open(t, audit.Options{Path: path, MaxBytes: max, Keep: 2})
	const n = 100
	for i := range n {
		l.Observe(event.Session{Time: time.Now(), Op: event.SessionCreate, Principal: "p", Session: strings.Repeat("s", i%40+1), Backend: "jail"})
	}
	l.Close()
	total := 0
	for _, p := range []string{path, path + ".1", path + ".2"} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatalf("after %d records: %v", n, err)
		}
		if st.Size() > max {
			t.Errorf("%s is %d bytes, past the bound of %d", p, st.Size(), max)
		}
		if m := st.Mode().Perm(); m != 0o600 {
			t.Errorf("%s has mode %v, want 0600", p, m)
		}
		total += len(records(t, p))
	}
	if _, err := os.Stat(path + ".3"); !os.IsNotExist(err) {
		t.Errorf("%s.3 exists past Keep=2 (err %v)", path, err)
	}
	if total >= n || total == 0 {
		t.Errorf("%d records in the kept files, want fewer than the %d written (old ones dropped) and some", total, n)
	}
	// The newest record is in the current file.
	recs := records(t, path)
	if last := recs[len(recs)-1]["session"]; last != strings.Repeat("s", (n-1)%40+1) {
		t.Errorf("last record of the current file is session %v, not the last written", last)
	}
}

// TestSecretsNeverLogged runs real code through the session manager on
// the in-process backend (the real agent and python kernel): a secret the
// code prints, writes to stderr, raises and returns never reaches the
// audit log, nor one written in the code itself unless IncludeCode is
// set. The record is there, with the code's hash.
func TestSecretsNeverLogged(t *testing.T) {
	const printed = "PRINTED-SECRET-5f1b2c"
	const inCode = "CODE-SECRET-9a8e77"
	// The printed secret is built at run time, so it is not in the code.
	code := "# " + inCode + "\nimport sys\ns = ''.join(reversed(" + quote(reverse(printed)) + "))\nprint(s); sys.stderr.write(s)\ns"
	sum := sha256.Sum256([]byte(code))
	for _, include := range []bool{false, true} {
		path := filepath.Join(t.TempDir(), "audit.log")
		l := open(t, audit.Options{Path: path, IncludeCode: include})
		b := sessiontest.New(t, &sessiontest.Options{Python: sessiontest.Python(t)})
		mgr := session.NewManager(session.Options{Backend: b, Observer: l})
		s, err := mgr.Get("alice", "work")
		if err != nil {
			t.Fatal(err)
		}
		out, err := s.RunPython(context.Background(), code, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.Stdout.Text, printed) {
			t.Fatalf("the code did not print the secret: %+v", out.ExecResult)
		}
		out, err = s.RunPython(context.Background(), "raise ValueError(''.join(reversed("+quote(reverse(printed))+")))", 30*time.Second)
		if err != nil || out.Error == nil || !strings.Contains(out.Error.Value, printed) {
			t.Fatalf("raising the secret: %v %+v", err, out)
		}
		mgr.Reset("alice", "work")
		mgr.Close()
		l.Close()
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(raw), printed) {
			t.Errorf("IncludeCode=%v: the secret the code printed is in the audit log:\n%s", include, raw)
		}
		if got := strings.Contains(string(raw), inCode); got != include {
			t.Errorf("IncludeCode=%v: the secret in the code is in the log: %v\n%s", include, got, raw)
		}
		var kinds []string
		var exec map[string]any
		for _, r := range records(t, path) {
			kinds = append(kinds, r["type"].(string)+":"+str(r["op"])+str(r["result"]))
			if r["type"] == "exec" && exec == nil {
				exec = r
			}
		}
		if diff := cmp.Diff([]string{"session:create", "exec:ok", "exec:error", "session:reset"}, kinds); diff != "" {
			t.Errorf("records (-want +got):\n%s", diff)
		}
		if exec["code_sha256"] != hex.EncodeToString(sum[:]) || exec["principal"] != "alice" || exec["session"] != "work" ||
			exec["stdout_bytes"] != float64(len(printed)+1) || exec["stderr_bytes"] != float64(len(printed)) {
			t.Errorf("exec record: %v", exec)
		}
	}
}

func str(v any) string {
	s, _ := v.(string)
	return s
}

func reverse(s string) string {
	r := []rune(s)
	for i, j := 0, len(r)-1; i < j; i, j = i+1, j-1 {
		r[i], r[j] = r[j], r[i]
	}
	return string(r)
}

func quote(s string) string { return "'" + s + "'" }

// TestEgressFloodBounded: a box that makes a hundred thousand refused
// attempts cannot flush the log. Its first refusals are written in full,
// the rest are counted into a summary record; the box's own exec record
// written before the flood, another box's records and the allowed
// attempt hidden in the flood all survive a rotation-bounded log.
func TestEgressFloodBounded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	// 64 KiB a file, two kept: the 36 MiB of the flood would rotate past
	// everything many times over.
	l := open(t, audit.Options{Path: path, MaxBytes: 64 << 10, Keep: 2})
	at := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	l.Observe(event.Exec{Time: at, Principal: "alice", Session: "work", Box: "flooder", Backend: "jail", Language: "python", Code: "first", Result: event.ResultOK})
	l.Observe(event.Exec{Time: at, Principal: "bob", Session: "s", Box: "quiet", Backend: "jail", Language: "python", Code: "bob", Result: event.ResultOK})
	const flood = 100_000
	for i := range flood {
		// 10 s of attempts, as measured.
		when := at.Add(time.Duration(i) * (10 * time.Second / flood))
		l.Observe(event.Egress{Time: when, Box: "flooder", Via: "dns", Name: fmt.Sprintf("n%d.evil.example", i), Verdict: event.VerdictRefuse, Reason: "not in the allowlist"})
		if i == flood/2 {
			l.Observe(event.Egress{Time: when, Box: "flooder", Via: "proxy", Name: "pypi.org", Port: 443, Verdict: event.VerdictAllow})
			l.Observe(event.Egress{Time: when, Box: "quiet", Via: "dns", Name: "other.example", Verdict: event.VerdictRefuse, Reason: "not in the allowlist"})
		}
	}
	end := at.Add(10 * time.Second)
	l.Observe(event.Exec{Time: end, Principal: "alice", Session: "work", Box: "flooder", Backend: "jail", Language: "python", Code: "second", Result: event.ResultOK})
	l.Close()

	var recs []map[string]any
	for _, p := range []string{path + ".2", path + ".1", path} {
		if _, err := os.Stat(p); err == nil {
			recs = append(recs, records(t, p)...)
		}
	}
	var execs, refusals, allowed, quiet int
	suppressed := 0.0
	for _, r := range recs {
		switch {
		case r["type"] == "exec":
			execs++
		case r["type"] == "egress" && r["box"] == "quiet":
			quiet++
		case r["type"] == "egress" && r["verdict"] == "allow":
			allowed++
		case r["type"] == "egress":
			refusals++
		case r["type"] == "egress_suppressed" && r["box"] == "flooder" && r["verdict"] == "refuse":
			n, _ := r["suppressed"].(float64)
			suppressed += n
		}
	}
	if execs != 3 || quiet != 1 || allowed != 1 {
		t.Errorf("after the flood the log holds %d exec records (want 3), %d of the other box (want 1), %d allowed attempts (want 1)", execs, quiet, allowed)
	}
	if refusals == 0 || refusals > 100 {
		t.Errorf("%d refusals of the flooding box written in full; want the first few, at most 100", refusals)
	}
	if int(suppressed)+refusals != flood {
		t.Errorf("%d refusals written and %v counted as suppressed; want %d in all", refusals, suppressed, flood)
	}
	if len(recs) > 200 {
		t.Errorf("the flood left %d records", len(recs))
	}
	// The summary comes before the box's next exec record.
	last := -1
	for i, r := range recs {
		if r["type"] == "egress_suppressed" {
			last = i
		}
	}
	if n := len(recs); last < 0 || recs[n-1]["type"] != "exec" || last > n-2 {
		t.Errorf("the suppressed refusals are not summed up before the box's exec record: last summary at %d of %d", last, n)
	}
}

// BenchmarkEgressFlood is the cost of one refused attempt of a flooding
// box, and the bytes of log it leaves (log-B/op).
func BenchmarkEgressFlood(b *testing.B) {
	path := filepath.Join(b.TempDir(), "audit.log")
	l, err := audit.Open(audit.Options{Path: path, MaxBytes: -1})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	at := time.Now()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		l.Observe(event.Egress{Time: at.Add(time.Duration(i) * 100 * time.Microsecond), Box: "flooder", Via: "dns", Name: "n.evil.example", Verdict: event.VerdictRefuse, Reason: "not in the allowlist"})
	}
	b.StopTimer()
	fi, err := os.Stat(path)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(fi.Size())/float64(b.N), "log-B/op")
}

// TestForeignLogRefused: an existing log that belongs to another user is
// refused: its owner could rewrite the records whatever its mode.
func TestForeignLogRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("giving a file to another uid needs root")
	}
	path := filepath.Join(t.TempDir(), "audit.log")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, 4242, 4242); err != nil {
		t.Fatal(err)
	}
	l, err := audit.Open(audit.Options{Path: path})
	if err == nil {
		l.Close()
	}
	if !errors.Is(err, config.ErrUnsafeFile) || !strings.Contains(err.Error(), "uid 4242") {
		t.Errorf("an audit log of uid 4242: err = %v, want ErrUnsafeFile naming the uid", err)
	}
}

// TestEgressSummaryWithoutBox: a box that floods and then goes quiet,
// and never runs again, still has its flood summed up once its window
// ended, at whatever record comes next, not only at shutdown.
func TestEgressSummaryWithoutBox(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	l := open(t, audit.Options{Path: path})
	at := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	for i := range 100 {
		l.Observe(event.Egress{Time: at.Add(time.Duration(i) * time.Millisecond), Box: "gone", Via: "dns", Name: "x.example", Verdict: event.VerdictRefuse})
	}
	l.Observe(event.Session{Time: at.Add(2 * time.Minute), Op: event.SessionCreate, Principal: "bob", Session: "s", Backend: "jail"})
	var summed float64
	for _, r := range records(t, path) {
		if r["type"] == "egress_suppressed" && r["box"] == "gone" {
			summed += r["suppressed"].(float64)
		}
	}
	if summed != 80 {
		t.Errorf("before close, %v of the quiet box's 80 suppressed refusals are summed up", summed)
	}
}
