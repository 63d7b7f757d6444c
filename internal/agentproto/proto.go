// Package agentproto defines the wire protocol between kiln (the host) and
// kiln-agent (inside every sandbox): length-prefixed JSON frames over one
// byte stream (a pipe, virtio-serial, vsock or socket).
//
// It uses the standard library only: the agent imports it, and code inside
// the box never imports host code.
package agentproto

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// MaxFrame bounds a single frame. A peer that announces more is broken or
// hostile; the decoder refuses it without allocating.
const MaxFrame = 64 << 20

// Operations a host may ask of the agent.
const (
	OpPython    = "python"    // run a cell in the persistent kernel
	OpShell     = "shell"     // run a bash command in the workspace
	OpWrite     = "write"     // write a file under the workspace
	OpRead      = "read"      // read a file under the workspace
	OpList      = "list"      // list a directory under the workspace
	OpInterrupt = "interrupt" // interrupt whatever is running
	OpChanges   = "changes"   // list files changed since a mark
	OpPing      = "ping"
	// OpLimits asks what the box's limits stopped so far (Response.Limits).
	// No agent answers it: a kiln node does, from its own count of the
	// box it relays to (an agent refuses it as any unknown operation).
	OpLimits = "limits"
	// OpBind binds the box to a session (Request.Key, a digest of the
	// session's principal and name), so that the box outlives its front's
	// connection for a while and another front may adopt it; OpUnbind
	// undoes that before the front closes the box on purpose. Only a kiln
	// node answers them, as OpLimits.
	OpBind   = "bind"
	OpUnbind = "unbind"
)

// Hello is the first frame the agent sends, once its kernel is ready.
type Hello struct {
	Version   int      `json:"version"`
	Python    string   `json:"python,omitempty"`    // python version, "" if none
	Preloaded []string `json:"preloaded,omitempty"` // modules imported at start
	Error     string   `json:"error,omitempty"`     // the agent could not start
	// Plan is the digest (boxpolicy.Plan.Digest) of the box plan the
	// box built itself from, where the box did so from a plan the host
	// sent it (a microVM guest); "" elsewhere. A host that sent one
	// refuses a box that does not say it applied it.
	Plan string `json:"plan,omitempty"`
}

// Request is a host → agent frame.
type Request struct {
	ID        uint64 `json:"id"`
	Op        string `json:"op"`
	Code      string `json:"code,omitempty"`       // OpPython source, OpShell command
	Path      string `json:"path,omitempty"`       // file operations, relative to the workspace
	Data      []byte `json:"data,omitempty"`       // OpWrite content, OpWriteState chunk
	MaxOutput int    `json:"max_output,omitempty"` // cap per stream, in bytes
	MaxBytes  int64  `json:"max_bytes,omitempty"`  // OpRead cap
	Offset    int64  `json:"offset,omitempty"`     // OpRead, OpReadState, OpWriteState: the first byte
	Since     int64  `json:"since,omitempty"`      // OpChanges: unix nanoseconds
	// Live asks the agent to send Output frames while an OpPython or
	// OpShell request runs.
	Live bool `json:"live,omitempty"`
	// Key is OpBind's session key.
	Key string `json:"key,omitempty"`
}

// Response is an agent → host frame answering the Request with the same ID.
type Response struct {
	ID    uint64      `json:"id"`
	Error string      `json:"error,omitempty"` // the operation itself failed (bad path, …)
	Exec  *ExecResult `json:"exec,omitempty"`
	Data  []byte      `json:"data,omitempty"`
	Size  int64       `json:"size,omitempty"` // OpRead: the file's full size
	// Offset is where an OpRead answer's Data starts in the file: the
	// request's Offset, echoed so that the host can tell an agent that
	// does not know ranged reads (and answered from 0) from one that does.
	Offset int64      `json:"offset,omitempty"`
	Files  []FileInfo `json:"files,omitempty"`
	// State answers OpSaveState and OpLoadState.
	State *StateInfo `json:"state,omitempty"`
	// Limits answers OpLimits.
	Limits *Limits `json:"limits,omitempty"`
	// Output, when set, makes this frame a progress report of the running
	// request ID rather than its answer: the request stays pending.
	Output *Output `json:"output,omitempty"`
}

// Limits counts what a box's limits stopped since it started; -1: not
// counted (sandbox.LimitHits on the wire).
type Limits struct {
	OOMKills    int64 `json:"oom_kills"`
	PidsRefused int64 `json:"pids_refused"`
}

// Output is the newest output of a running exec request that asked for it
// (Request.Live): the tail of its stdout and stderr as they interleaved,
// at most MaxLiveTail bytes. The agent sends one at most every
// LiveInterval, and only when there is something new.
type Output struct {
	Tail  string `json:"tail"`
	Total int64  `json:"total"` // bytes the call has written so far
}

// ExecResult is what one cell or command produced.
type ExecResult struct {
	Stdout    Stream       `json:"stdout"`
	Stderr    Stream       `json:"stderr"`
	Result    MimeBundle   `json:"result,omitempty"`   // the cell's last expression
	Displays  []MimeBundle `json:"displays,omitempty"` // display() calls and figures, in order
	Error     *ExecError   `json:"error,omitempty"`
	ExitCode  int          `json:"exit_code"`
	Signal    string       `json:"signal,omitempty"`
	Interrupt bool         `json:"interrupted,omitempty"`
	// Notes say what the agent or the host cut, for the model.
	Notes []string `json:"notes,omitempty"`
}

// Stream is captured output, capped by keeping its head and tail.
type Stream struct {
	Text  string `json:"text"`
	Total int64  `json:"total"`         // bytes produced, including dropped ones
	Cut   int    `json:"cut,omitempty"` // offset in Text where dropped bytes were
}

// Truncated reports how many bytes were dropped from the middle.
func (s Stream) Truncated() int64 { return s.Total - int64(len(s.Text)) }

// MimeBundle maps a MIME type to its representation. Binary types (image/png)
// are base64 strings, as in Jupyter's display protocol.
type MimeBundle map[string]string

// ExecError describes an exception raised by the cell.
type ExecError struct {
	Name      string `json:"ename"`
	Value     string `json:"evalue"`
	Traceback string `json:"traceback"`
}

// FileInfo describes one entry of a workspace directory.
type FileInfo struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	Dir     bool   `json:"dir,omitempty"`
	Symlink bool   `json:"symlink,omitempty"`
	ModNano int64  `json:"mtime_ns,omitempty"`
	// Special is set for what is neither a regular file, a directory nor
	// a symlink: "fifo", "socket", "device", "char-device" or "other".
	Special string `json:"special,omitempty"`
}

// ErrFrameTooLarge is returned for a frame longer than MaxFrame.
var ErrFrameTooLarge = errors.New("agentproto: frame too large")

// WriteFrame writes v as one frame.
// HTML is not escaped: "<" costs one byte on the wire, not six, so rich
// output is charged (MaxRich) at about its size.
func WriteFrame(w io.Writer, v any) error {
	var buf bytes.Buffer
	buf.Write([]byte{0, 0, 0, 0})
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("encoding frame: %w", err)
	}
	b := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	n := len(b) - 4
	if n > MaxFrame {
		return ErrFrameTooLarge
	}
	binary.BigEndian.PutUint32(b, uint32(n))
	_, err := w.Write(b)
	return err
}

// ReadFrame reads one frame into v.
func ReadFrame(r io.Reader, v any) error { return ReadFrameMax(r, v, nil) }

// ReadFrameMax reads one frame into v, refusing one longer than max
// returns once its header is in (MaxFrame if max is nil): the host reads
// an answer within what the requests in flight can take (MaxAnswer), not
// within what the protocol allows.
func ReadFrameMax(r io.Reader, v any, max func() int) error {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	limit := MaxFrame
	if max != nil {
		limit = min(limit, max())
	}
	if int64(n) > int64(limit) {
		return fmt.Errorf("%w: %d bytes announced, at most %d expected", ErrFrameTooLarge, n, limit)
	}
	// Trust the header only once the peer has sent a first MiB: a peer
	// that announces MaxFrame and sends nothing costs nothing, and an
	// honest frame is read into one buffer of its exact size. (Growing the
	// buffer step by step left garbage of the frame's size or more, which
	// pushed the agent of a 256 MiB box over its limit on a 33 MiB write.)
	b := make([]byte, min(int(n), 1<<20))
	if _, err := io.ReadFull(r, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return err
	}
	if int(n) > len(b) {
		full := make([]byte, n)
		copy(full, b)
		if _, err := io.ReadFull(r, full[len(b):]); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
		b = full
	}
	if err := checkShape(b); err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return &Fault{fmt.Sprintf("decoding frame: %v", err)}
	}
	return nil
}
