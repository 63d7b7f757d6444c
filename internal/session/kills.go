package session

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// What kiln tells the model when a limit ends or breaks a call, and what
// survived it. Every such message is here, so that they read alike and
// name the limit with its value.
const (
	msgMemory   = "the sandbox ran out of memory (limit %d MiB)"
	msgPids     = "the process limit (%d) was reached: %d process or thread starts were refused"
	msgDisk     = "the %s is full (%d MiB): a write failed for lack of space"
	msgTime     = "the call ran past its time limit of %s"
	msgCancel   = "the client cancelled the call"
	msgMaybeOOM = "the memory limit is %d MiB; this backend does not report whether it was the cause"

	msgInterrupted = "%s; it was interrupted"
	msgNotStopped  = "%s; the code did not stop when interrupted, so its sandbox was destroyed"

	msgDiedUnknown  = "the sandbox died (a crash, or a limit this backend does not report)"
	msgDiedMaybeOOM = "the sandbox died: its memory limit of %d MiB or a crash (this backend cannot tell which)"
	msgProtocol     = "kiln destroyed the previous sandbox because it broke the agent protocol (a frame from it failed validation)"
	msgUnanswered   = "kiln destroyed the previous sandbox because its agent stopped answering"
	msgFaulted      = "kiln destroyed the previous sandbox because kiln itself faulted on a call to it"
	msgPrevDied     = "the previous sandbox died between calls: %s"
	msgNewBox       = "this call runs in a new one"
	// A box lost with its host (a kiln node), in a server that saves
	// sessions: the loss bound is the checkpoint's age.
	msgFromCheckpoint = "the next call resumes this session from its last save, if it has one (--checkpoint-every bounds what is lost: the calls after that save)"

	// What survived, by what happened to the box.
	keptState     = "the session's state is kept"
	kernelLost    = "the session restarted: variables and imports are gone; files in the workspace are kept"
	boxLost       = "the session restarted: variables, imports and files in the workspace are gone"
	perCallLost   = "per-call mode: nothing of this call's sandbox is kept, and its files are not returned"
	perCallKernel = "per-call mode: the files it wrote are still returned"
)

// survived says what is left after a call, by mode and by how much of the
// box was lost: nothing (kept), the python kernel, or the whole box.
func (m *Manager) survived(kernel, box bool) string {
	switch {
	case m.opts.Mode == ModePerCall && box:
		return perCallLost
	case m.opts.Mode == ModePerCall:
		if kernel {
			return perCallKernel
		}
		return ""
	case box:
		return boxLost
	case kernel:
		return kernelLost
	}
	return keptState
}

// hostLost says how the host a dead box ran on was lost with it (a kiln
// node), "" when it was not or the backend cannot tell.
func hostLost(box sandbox.Sandbox) string {
	if r, ok := inner(box).(sandbox.HostLossReporter); ok {
		return r.HostLost()
	}
	return ""
}

// afterLoss says what is left of a session whose box went with its host:
// with saved sessions, the next call resumes from its last save.
func (m *Manager) afterLoss() string {
	if m.hib != nil && m.opts.Mode != ModePerCall {
		return msgFromCheckpoint
	}
	return m.survived(true, true)
}

// limitSeconds renders a time limit: "30 s", or "500ms" below a second or
// when it is not whole.
func limitSeconds(d time.Duration) string {
	if d >= time.Second && d%time.Second == 0 {
		return fmt.Sprintf("%d s", d/time.Second)
	}
	return d.Round(time.Millisecond).String()
}

// hits reads a box's limit counters; nil when its backend does not count.
func hits(box sandbox.Sandbox) *sandbox.LimitHits {
	r, ok := inner(box).(sandbox.LimitReporter)
	if !ok {
		return nil
	}
	h := r.LimitHits()
	return &h
}

// delta is what the limits stopped between two readings: -1 where a
// count is not known.
func delta(before, after *sandbox.LimitHits) sandbox.LimitHits {
	d := sandbox.LimitHits{OOMKills: -1, PidsRefused: -1}
	if before == nil || after == nil {
		return d
	}
	if before.OOMKills >= 0 && after.OOMKills >= 0 {
		d.OOMKills = after.OOMKills - before.OOMKills
	}
	if before.PidsRefused >= 0 && after.PidsRefused >= 0 {
		d.PidsRefused = after.PidsRefused - before.PidsRefused
	}
	return d
}

// oomKnown reports whether box's memory limit killed something: by the
// counters when the backend has them, else by OOMReporter.
func oomKnown(box sandbox.Sandbox, d sandbox.LimitHits) (killed, known bool) {
	if d.OOMKills >= 0 {
		return d.OOMKills > 0, true
	}
	if o, ok := inner(box).(sandbox.OOMReporter); ok {
		return o.OOMKilled(), true
	}
	return false, false
}

// diedReason says why a box died during a call.
func (m *Manager) diedReason(box sandbox.Sandbox, d sandbox.LimitHits) string {
	if why := hostLost(box); why != "" {
		return why
	}
	switch oom, known := oomKnown(box, d); {
	case oom:
		return fmt.Sprintf(msgMemory, m.opts.Limits.MemoryBytes>>20)
	case !known:
		return fmt.Sprintf(msgDiedMaybeOOM, m.opts.Limits.MemoryBytes>>20)
	}
	return msgDiedUnknown
}

// explainLimits adds to a finished call's outcome what the box's limits
// did to it: the memory limit killing the kernel or a command, forks
// refused at the pids limit, a full workspace. The box is alive.
func (m *Manager) explainLimits(out *Outcome, box sandbox.Sandbox, d sandbox.LimitHits) {
	res := out.ExecResult
	if res == nil {
		return
	}
	l := m.opts.Limits
	kernelDied := res.Error != nil && res.Error.Name == "KernelDied"
	oom, known := oomKnown(box, d)
	switch {
	case kernelDied && oom:
		res.Error.Value = fmt.Sprintf(msgMemory, l.MemoryBytes>>20) + ": the Python process was killed"
		out.Note = joinNote(out.Note, joinNote(fmt.Sprintf(msgMemory, l.MemoryBytes>>20), m.survived(true, false)))
	case kernelDied && !known && res.Signal == "SIGKILL":
		out.Note = joinNote(out.Note, joinNote(fmt.Sprintf(msgMaybeOOM, l.MemoryBytes>>20), m.survived(true, false)))
	case kernelDied:
		out.Note = joinNote(out.Note, m.survived(true, false))
	case oom && d.OOMKills >= 0:
		// A command (or a process the cell started) was killed; the
		// kernel, if any, lives on.
		out.Note = joinNote(out.Note, fmt.Sprintf(msgMemory, l.MemoryBytes>>20)+" and a process in it was killed; "+m.survived(false, false))
	}
	if d.PidsRefused > 0 {
		out.Note = joinNote(out.Note, joinNote(fmt.Sprintf(msgPids, l.Pids, d.PidsRefused), m.survived(false, false)))
	}
	if where := diskFull(res, m.opts.Limits); where != "" {
		out.Note = joinNote(out.Note, joinNote(where, m.survived(false, false)))
	}
}

// diskFullMarks are how ENOSPC and EDQUOT read in tracebacks and in the
// stderr of shell tools.
var diskFullMarks = []string{"No space left on device", "Disk quota exceeded", "[Errno 28]", "[Errno 122]"}

// diskFull names the full filesystem if the call's output says a write
// failed for lack of space: /tmp when the message names it, else the
// workspace.
func diskFull(res *agentproto.ExecResult, l sandbox.Limits) string {
	texts := []string{res.Stderr.Text, res.Stdout.Text}
	if res.Error != nil {
		texts = append(texts, res.Error.Value, res.Error.Traceback)
	}
	for _, t := range texts {
		for _, mark := range diskFullMarks {
			i := strings.Index(t, mark)
			if i < 0 {
				continue
			}
			line := t[strings.LastIndexByte(t[:i], '\n')+1:]
			if j := strings.IndexByte(line, '\n'); j >= 0 {
				line = line[:j]
			}
			if strings.Contains(line, "/tmp/") || strings.Contains(line, "'/tmp'") {
				return fmt.Sprintf(msgDisk, "/tmp directory", l.TmpBytes>>20)
			}
			return fmt.Sprintf(msgDisk, "workspace", l.WorkspaceBytes>>20)
		}
	}
	return ""
}

// deathReporter is a box that can say why it is done (AgentConn.Err).
type deathReporter interface{ Err() error }

// faultReason is lostReason for a box found dead between calls: a fault
// kiln saw on its stream after the last call had returned.
func faultReason(box sandbox.Sandbox) string {
	if r, ok := inner(box).(deathReporter); ok {
		return lostReason(r.Err())
	}
	return ""
}

// lostReason says why kiln dropped a box after a call that failed with
// err, for the session's next call; "" when the box is fine or err says
// nothing about it.
func lostReason(err error) string {
	switch {
	case errors.Is(err, sandbox.ErrBroken):
		return msgProtocol
	case errors.Is(err, sandbox.ErrUnresponsive):
		return msgUnanswered
	case errors.Is(err, errFaulted):
		return msgFaulted
	}
	return ""
}
