// Package audit writes kiln's audit log: one JSON object per line for
// every execution, every egress attempt of a box and every change in a
// session's life, to a file only its owner can read, rotated by size.
//
// What a record holds is fixed here, field by field, so that nothing a
// box produced can reach the log by accident: an execution is recorded by
// the SHA-256 and size of its code, its result class, the limits it hit
// and the sizes of its output, never the output itself, and the code only
// when Options.IncludeCode is set. Egress records hold the name a box
// asked for and the verdict, bounded by the gateway, and how many a box
// gets is bounded here (egressBurst), so that no box can rotate the
// records of others, or its own exec record, out of the log.
package audit

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"kiln/internal/event"
)

// Defaults of Options.
const (
	DefaultMaxBytes = 100 << 20
	DefaultKeep     = 5
)

// Bounds on the egress records of one box. A box makes attempts at will
// (100,891 refusals in 10 s were measured, 36 MiB of records), and the
// log's size is bounded by rotation, so unbounded they would rotate every
// other record out of it, the box's own exec record first. Per box and
// verdict, egressBurst attempts are written in full per egressWindow; the
// rest are counted, and an egress_suppressed record sums them up before
// the box's next record after its window (an attempt, or its exec
// record), or when the log closes. Verdicts are counted apart, so a flood
// of refusals cannot hide the attempt the policy allowed.
const (
	egressBurst  = 20
	egressWindow = time.Minute
)

// Options configure a Log.
type Options struct {
	Path string // the log file; created with mode 0600
	// MaxBytes is the size past which the file is rotated: it becomes
	// Path.1 (Path.1 becomes Path.2, …) and a new file is started. 0:
	// DefaultMaxBytes; negative: never rotate.
	MaxBytes int64
	// Keep is how many rotated files are kept (Path.1 … Path.Keep); older
	// ones are removed. 0: DefaultKeep; negative: none (the log restarts
	// empty).
	Keep int
	// IncludeCode writes the code of every execution into its record.
	// Output is never written.
	IncludeCode bool
	Logger      *slog.Logger // where write failures are reported
}

// Log is an open audit log. It implements event.Observer.
type Log struct {
	opts Options
	log  *slog.Logger

	mu     sync.Mutex
	w      *rotator
	failed bool // the last write failed (logged once until one succeeds)
	// egress counts each box's egress records in its current window;
	// entries of windows that ended are swept every egressWindow.
	egress map[egressKey]*egressCount
	swept  time.Time
}

type egressKey struct{ box, verdict string }

type egressCount struct {
	start      time.Time // the window's
	written    int
	suppressed int
	first      time.Time // the first and last suppressed attempts
	last       time.Time
}

var _ event.Observer = (*Log)(nil)

// Open opens (or creates) the audit log at opts.Path.
func Open(opts Options) (*Log, error) {
	if opts.MaxBytes == 0 {
		opts.MaxBytes = DefaultMaxBytes
	}
	if opts.Keep == 0 {
		opts.Keep = DefaultKeep
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	w, err := openRotator(opts.Path, opts.MaxBytes, opts.Keep)
	if err != nil {
		return nil, err
	}
	return &Log{opts: opts, log: opts.Logger, w: w, egress: map[egressKey]*egressCount{}}, nil
}

// Close closes the file. Events after Close are dropped.
func (l *Log) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.w == nil {
		return nil
	}
	now := time.Now()
	for k, c := range l.egress {
		l.summarizeLocked(k, c, now)
	}
	err := l.w.close()
	l.w = nil
	return err
}

// Records, as written. Field names are part of the log's format.

type execRecord struct {
	Time        string   `json:"time"`
	Type        string   `json:"type"`
	Principal   string   `json:"principal"`
	Session     string   `json:"session,omitempty"`
	Box         string   `json:"box,omitempty"`
	Backend     string   `json:"backend"`
	Language    string   `json:"language"`
	CodeSHA256  string   `json:"code_sha256"`
	CodeBytes   int      `json:"code_bytes"`
	DurationMS  float64  `json:"duration_ms"`
	Result      string   `json:"result"`
	LimitsHit   []string `json:"limits_hit"`
	StdoutBytes int64    `json:"stdout_bytes"`
	StderrBytes int64    `json:"stderr_bytes"`
	Restarted   bool     `json:"restarted,omitempty"`
	Code        *string  `json:"code,omitempty"`
}

type egressRecord struct {
	Time    string `json:"time"`
	Type    string `json:"type"`
	Box     string `json:"box"`
	Via     string `json:"via"`
	Name    string `json:"name,omitempty"`
	Port    uint16 `json:"port,omitempty"`
	Verdict string `json:"verdict"`
	Reason  string `json:"reason,omitempty"`
}

// suppressedRecord sums up the egress attempts of one box and verdict
// that were counted, not written.
type suppressedRecord struct {
	Time       string `json:"time"`
	Type       string `json:"type"`
	Box        string `json:"box"`
	Verdict    string `json:"verdict"`
	Suppressed int    `json:"suppressed"`
	From       string `json:"from"` // the first of them
	To         string `json:"to"`   // the last
	Note       string `json:"note"`
}

type sessionRecord struct {
	Time      string `json:"time"`
	Type      string `json:"type"`
	Op        string `json:"op"`
	Principal string `json:"principal"`
	Session   string `json:"session"`
	Backend   string `json:"backend"`
}

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// record builds what e is written as; nil for events the log does not
// keep (box creations: those are for the metrics).
func (l *Log) record(e event.Event) any {
	switch e := e.(type) {
	case event.Exec:
		sum := sha256.Sum256([]byte(e.Code))
		r := execRecord{
			Time: stamp(e.Time), Type: "exec", Principal: e.Principal, Session: e.Session, Box: e.Box,
			Backend: e.Backend, Language: e.Language,
			CodeSHA256: hex.EncodeToString(sum[:]), CodeBytes: len(e.Code),
			DurationMS: float64(e.Duration.Microseconds()) / 1000, Result: e.Result,
			LimitsHit: append([]string{}, e.LimitsHit...), StdoutBytes: e.StdoutBytes, StderrBytes: e.StderrBytes,
			Restarted: e.Restarted,
		}
		if l.opts.IncludeCode {
			r.Code = &e.Code
		}
		return r
	case event.Egress:
		return egressRecord{
			Time: stamp(e.Time), Type: "egress", Box: e.Box, Via: e.Via, Name: e.Name, Port: e.Port,
			Verdict: e.Verdict, Reason: e.Reason,
		}
	case event.Session:
		return sessionRecord{
			Time: stamp(e.Time), Type: "session", Op: e.Op, Principal: e.Principal, Session: e.Session,
			Backend: e.Backend,
		}
	}
	return nil
}

// Observe writes e's record, one line; past a box's bound, an egress
// attempt is counted instead (egressBurst).
func (l *Log) Observe(e event.Event) {
	r := l.record(e)
	if r == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.w == nil {
		return
	}
	switch e := e.(type) {
	case event.Egress:
		l.sweepLocked(e.Time)
		if !l.admitLocked(e) {
			return
		}
	case event.Session:
		l.sweepLocked(e.Time)
	case event.Exec:
		l.sweepLocked(e.Time)
		// What the box's attempts came to, before what it ran.
		for k, c := range l.egress {
			if k.box == e.Box && e.Box != "" {
				l.summarizeLocked(k, c, e.Time)
			}
		}
	}
	l.writeLocked(r)
}

// admitLocked says whether e, an egress attempt, is written in full, and
// counts it if not. l.mu is held.
func (l *Log) admitLocked(e event.Egress) bool {
	k := egressKey{e.Box, e.Verdict}
	c := l.egress[k]
	if c == nil || e.Time.Sub(c.start) >= egressWindow {
		if c != nil {
			l.summarizeLocked(k, c, e.Time)
		}
		c = &egressCount{start: e.Time}
		l.egress[k] = c
	}
	if c.written < egressBurst {
		c.written++
		return true
	}
	if c.suppressed == 0 {
		c.first = e.Time
	}
	c.suppressed++
	c.last = e.Time
	return false
}

// summarizeLocked writes the egress_suppressed record of c, if it counted
// any, and starts counting again. l.mu is held.
func (l *Log) summarizeLocked(k egressKey, c *egressCount, now time.Time) {
	if c.suppressed == 0 {
		return
	}
	l.writeLocked(suppressedRecord{
		Time: stamp(now), Type: "egress_suppressed", Box: k.box, Verdict: k.verdict, Suppressed: c.suppressed,
		From: stamp(c.first), To: stamp(c.last),
		Note: fmt.Sprintf("%d more egress attempts (%s) of box %s not written: at most %d a box writes per %s and verdict", c.suppressed, k.verdict, k.box, egressBurst, egressWindow),
	})
	c.suppressed = 0
}

// sweepLocked, once per egressWindow, sums up and forgets the counts of
// windows that ended, so the counts held are those of boxes that made
// attempts lately. l.mu is held.
func (l *Log) sweepLocked(now time.Time) {
	if now.Sub(l.swept) < egressWindow {
		return
	}
	l.swept = now
	for k, c := range l.egress {
		if now.Sub(c.start) >= egressWindow {
			l.summarizeLocked(k, c, now)
			delete(l.egress, k)
		}
	}
}

// writeLocked writes r as one line. l.mu is held and l.w open.
func (l *Log) writeLocked(r any) {
	line, err := json.Marshal(r)
	if err != nil {
		l.log.Error("encoding an audit record", "err", err)
		return
	}
	line = append(line, '\n')
	if err := l.w.write(line); err != nil {
		if !l.failed {
			l.log.Error("writing the audit log", "path", l.opts.Path, "err", err)
		}
		l.failed = true
		return
	}
	if l.failed {
		l.log.Info("writing the audit log again", "path", l.opts.Path)
	}
	l.failed = false
}
