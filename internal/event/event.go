// Package event is what kiln reports about its own work to whoever
// watches it: the audit log and the metrics. The session manager and the
// egress gateway call an Observer at the points where results are made;
// what an observer does with an event is its own affair, and it must not
// block (it runs on the call's path).
//
// An event carries what is needed to account for the work and nothing a
// box produced: no output, no error text from the box. The code of an
// execution is carried so that an observer can hash it; only the audit log
// with --audit-include-code ever writes it out.
package event

import (
	"time"
)

// Observer receives kiln's events. Implementations must be safe for
// concurrent use and must not block.
type Observer interface {
	Observe(Event)
}

// Event is one of the types below.
type Event interface{ kind() string }

// Kind names an event's type as the audit log writes it: "exec",
// "egress", "session", "box".
func Kind(e Event) string { return e.kind() }

// Result classes of an execution.
const (
	ResultOK        = "ok"        // the code ran and succeeded
	ResultError     = "error"     // an exception, or a non-zero exit
	ResultTimeout   = "timeout"   // it ran past its time limit
	ResultOOM       = "oom"       // the memory limit killed it or a process of it
	ResultKilled    = "killed"    // the box died under it (a crash, or a limit the backend does not name)
	ResultCancelled = "cancelled" // the client went away or cancelled
	ResultBusy      = "busy"      // nothing ran: every box slot was taken
	ResultFault     = "fault"     // kiln's own fault, or a box that broke the protocol
)

// Limits a call can hit, as named in Exec.LimitsHit.
const (
	LimitMemory = "memory"
	LimitPids   = "pids"
	LimitDisk   = "disk"
	LimitTime   = "time"
)

// Exec is one run_python or run_shell call.
type Exec struct {
	Time      time.Time // when it ended
	Principal string
	Session   string // "" in per-call mode
	Box       string // the box's ID ("" if none was reached); egress events name it too
	Backend   string
	Language  string // "python" or "shell"
	Code      string // for hashing; written out only by an audit log told to
	Duration  time.Duration
	Result    string   // one of the Result* classes
	LimitsHit []string // Limit* names
	// StdoutBytes and StderrBytes are what the code wrote, before kiln's
	// cap on what is returned.
	StdoutBytes, StderrBytes int64
	Restarted                bool // the box was destroyed: the session's state is gone
}

func (Exec) kind() string { return "exec" }

// Egress verdicts.
const (
	VerdictAllow  = "allow"
	VerdictRefuse = "refuse"
	VerdictError  = "error" // allowed, but resolving or dialing failed
)

// Egress is one attempt of a box to reach the network through the gateway.
type Egress struct {
	Time    time.Time
	Box     string // the box's ID, as in Exec.Box
	Via     string // dns, proxy, connect, http, tls
	Name    string // the host name asked for (bounded by the gateway)
	Port    uint16
	Verdict string // one of the Verdict* values
	Reason  string // why it was refused, or the error
}

func (Egress) kind() string { return "egress" }

// Session operations.
const (
	SessionCreate   = "create"
	SessionReset    = "reset"
	SessionExpire   = "expire"
	SessionSnapshot = "snapshot" // reserved: snapshots are not built yet
	SessionRestore  = "restore"  // reserved
	SessionClose    = "close"    // destroyed at shutdown
	// SessionHibernate is a session saved to disk and its box destroyed
	// (idle, or at shutdown); SessionResume one restored from disk.
	SessionHibernate = "hibernate"
	SessionResume    = "resume"
)

// Session is a change in a named session's life.
type Session struct {
	Time      time.Time
	Op        string // one of the Session* operations
	Principal string
	Session   string
	Backend   string
}

func (Session) kind() string { return "session" }

// Box is a box creation, for a session, a per-call run or the pool.
type Box struct {
	Time     time.Time
	Backend  string
	Duration time.Duration
	Err      bool // creation failed
	// PoolMiss is set on the box-less event a call emits when it found
	// no ready box in the pool (only when the pool is on).
	PoolMiss bool
}

func (Box) kind() string { return "box" }

// Multi sends each event to every non-nil observer, in order.
func Multi(obs ...Observer) Observer {
	var out multi
	for _, o := range obs {
		if o != nil {
			out = append(out, o)
		}
	}
	switch len(out) {
	case 0:
		return nil
	case 1:
		return out[0]
	}
	return out
}

type multi []Observer

func (m multi) Observe(e Event) {
	for _, o := range m {
		o.Observe(e)
	}
}

// Emit sends e to o; a nil o drops it.
func Emit(o Observer, e Event) {
	if o != nil {
		o.Observe(e)
	}
}
