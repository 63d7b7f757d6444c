package agentproto

import (
	"encoding/base64"
	"errors"
	"fmt"
	"path"
	"strings"
	"time"
)

// Version is the protocol version an agent announces in its Hello.
const Version = 1

// Bounds on what the host accepts from a box. Everything that comes out of
// a box is hostile input: model code can reach whatever the agent can. An
// honest agent stays inside these bounds by construction, so a frame
// outside them is a fault of the box (Check), except for text that model
// code controls through an honest agent, which is cut with a note instead.
const (
	// DefaultMaxOutput is the agent's cap per stream when a request
	// names none.
	DefaultMaxOutput = 20000
	// MaxDisplays is the most display outputs one call may return (the
	// kernel driver keeps the first 64).
	MaxDisplays = 64
	// MaxRich bounds the rich output of one call: every representation of
	// the result and the displays together, as sent (base64 for images).
	// The driver keeps to it; the host drops what is beyond it while
	// decoding, so a box that ignores it costs no more than a frame.
	MaxRich = 4 << 20
	// MaxListEntries is the most entries a list or changes answer holds
	// (the agent stops walking at 1000).
	MaxListEntries = 1000
	// MaxItems bounds the members of any one JSON array or object in a
	// frame, checked before decoding: "[{},{},…]" costs three bytes a
	// member on the wire and a map each once decoded.
	MaxItems = 4096
	// MaxRead is the most file data a read answers with (the agent's
	// cap whatever the host asks).
	MaxRead = 16 << 20
	// MaxMessage bounds an error message, an exception's value or its
	// traceback as shown to the model; longer ones are cut with a note.
	MaxMessage = 64 << 10
	// MaxLiveTail bounds the tail an Output frame carries.
	MaxLiveTail = 2 << 10
	// LiveInterval is the least time between two Output frames of one
	// call, as the agent sends them.
	LiveInterval = time.Second
	maxPath      = 4096
	maxShort     = 256 // a signal name, a python version, a module name
	maxPreload   = 256
)

// Fault is a frame that broke the protocol. Its message says which field
// and why.
type Fault struct{ msg string }

func (f *Fault) Error() string { return f.msg }

func faultf(format string, args ...any) error { return &Fault{fmt.Sprintf(format, args...)} }

// IsFault reports whether err is a frame that broke the protocol (as
// opposed to a stream that ended).
func IsFault(err error) bool {
	var f *Fault
	return errors.As(err, &f) || errors.Is(err, ErrFrameTooLarge)
}

// Check validates the agent's first frame. It cuts the error message an
// agent that could not start sends; anything else out of bounds is a fault.
func (h *Hello) Check() error {
	if h.Version != Version {
		return faultf("hello: protocol version %d, want %d", h.Version, Version)
	}
	if len(h.Python) > maxShort {
		return faultf("hello: python version of %d bytes", len(h.Python))
	}
	if len(h.Preloaded) > maxPreload {
		return faultf("hello: %d preloaded modules, at most %d", len(h.Preloaded), maxPreload)
	}
	for _, m := range h.Preloaded {
		if len(m) > maxShort || m == "" {
			return faultf("hello: a preloaded module name of %d bytes", len(m))
		}
	}
	if len(h.Plan) > maxShort {
		return faultf("hello: a plan digest of %d bytes", len(h.Plan))
	}
	h.Error, _ = cutText(h.Error, MaxMessage)
	return nil
}

// Check validates a response against the request it answers, cutting text
// that model code controls through an honest agent (error messages, an
// exception's value and traceback) to MaxMessage with a note. Any other
// field out of bounds is a fault: a cut point outside its text, a stream
// longer than its cap, too many displays or entries, negative sizes,
// paths outside the workspace, fields the operation does not answer with.
func (r *Response) Check(req *Request) error {
	if r.ID != req.ID {
		return faultf("response id %d answers request %d", r.ID, req.ID)
	}
	if r.Output != nil {
		return r.checkOutput(req)
	}
	if msg, cut := cutText(r.Error, MaxMessage); cut {
		r.Error = msg
	}
	exec := req.Op == OpPython || req.Op == OpShell
	read := req.Op == OpRead || req.Op == OpReadState
	list := req.Op == OpList || req.Op == OpChanges
	state := req.Op == OpSaveState || req.Op == OpLoadState
	switch {
	case r.Exec != nil && !exec:
		return faultf("%s response carries an exec result", req.Op)
	case len(r.Data) > 0 && !read, r.Size != 0 && !read && req.Op != OpSaveState, r.Offset != 0 && !read:
		return faultf("%s response carries file data", req.Op)
	case len(r.Files) > 0 && !list:
		return faultf("%s response carries a file list", req.Op)
	case r.State != nil && !state:
		return faultf("%s response carries a state report", req.Op)
	case r.Limits != nil && req.Op != OpLimits:
		return faultf("%s response carries limit counts", req.Op)
	}
	switch {
	case exec:
		if r.Exec == nil {
			if r.Error == "" {
				return faultf("%s response without a result", req.Op)
			}
			return nil
		}
		return r.Exec.check(req.MaxOutput)
	case read:
		if r.Size < 0 {
			return faultf("read response: size %d", r.Size)
		}
		if r.Offset < 0 {
			return faultf("read response: offset %d", r.Offset)
		}
		if int64(len(r.Data)) > r.Size-min(r.Offset, r.Size) {
			return faultf("read response: %d bytes of data at offset %d for a file of size %d", len(r.Data), r.Offset, r.Size)
		}
		if req.MaxBytes > 0 && int64(len(r.Data)) > req.MaxBytes {
			return faultf("read response: %d bytes, %d asked", len(r.Data), req.MaxBytes)
		}
	case state:
		if r.Error != "" {
			return nil
		}
		if r.State == nil {
			return faultf("%s response without a state report", req.Op)
		}
		if r.Size < 0 {
			return faultf("%s response: size %d", req.Op, r.Size)
		}
		return r.State.check()
	case req.Op == OpLimits:
		if r.Error != "" {
			return nil
		}
		if l := r.Limits; l == nil || l.OOMKills < -1 || l.PidsRefused < -1 {
			return faultf("limits response: %+v", r.Limits)
		}
	case list:
		if len(r.Files) > MaxListEntries {
			return faultf("%s response: %d entries, at most %d", req.Op, len(r.Files), MaxListEntries)
		}
		for i, f := range r.Files {
			if err := f.check(); err != nil {
				return faultf("%s response: entry %d: %v", req.Op, i, err)
			}
		}
	}
	return nil
}

// specialKinds are the values of FileInfo.Special.
var specialKinds = map[string]bool{"": true, "fifo": true, "socket": true, "device": true, "char-device": true, "other": true}

func (f FileInfo) check() error {
	switch p := f.Path; {
	case p == "" || len(p) > maxPath:
		return fmt.Errorf("path of %d bytes", len(p))
	case strings.ContainsRune(p, 0), path.IsAbs(p), path.Clean(p) != p, p == "..", strings.HasPrefix(p, "../"):
		return fmt.Errorf("path %q is not inside the workspace", p)
	case f.Size < 0:
		return fmt.Errorf("size %d", f.Size)
	case f.Dir && f.Symlink:
		return errors.New("both a directory and a symlink")
	case !specialKinds[f.Special]:
		return fmt.Errorf("special kind %.40q", f.Special)
	}
	return nil
}

func (e *ExecResult) check(maxOutput int) error {
	if maxOutput <= 0 {
		maxOutput = DefaultMaxOutput
	}
	for _, s := range []struct {
		name string
		st   Stream
	}{{"stdout", e.Stdout}, {"stderr", e.Stderr}} {
		if err := s.st.check(maxOutput); err != nil {
			return faultf("%s: %v", s.name, err)
		}
	}
	if len(e.Displays) > MaxDisplays {
		return faultf("%d displays, at most %d", len(e.Displays), MaxDisplays)
	}
	if len(e.Signal) > maxShort {
		return faultf("signal name of %d bytes", len(e.Signal))
	}
	if err := e.Error; err != nil {
		var cut bool
		if len(err.Name) > maxShort {
			err.Name, cut = err.Name[:maxShort], true
		}
		v, c1 := cutText(err.Value, MaxMessage)
		tb, c2 := cutText(err.Traceback, MaxMessage)
		err.Value, err.Traceback = v, tb
		if cut || c1 || c2 {
			e.Notes = append(e.Notes, fmt.Sprintf("the exception's text was cut to %d bytes", MaxMessage))
		}
	}
	return nil
}

// check validates a stream kept under a cap of max bytes. The agent keeps
// valid UTF-8, so invalid bytes it replaced may triple the kept text.
func (s Stream) check(max int) error {
	switch {
	case s.Total < 0:
		return fmt.Errorf("total %d is negative", s.Total)
	case len(s.Text) > 3*max:
		return fmt.Errorf("%d bytes kept under a cap of %d", len(s.Text), max)
	case s.Cut < 0 || s.Cut > len(s.Text):
		return fmt.Errorf("cut %d is outside the text [0, %d]", s.Cut, len(s.Text))
	}
	return nil
}

// cutText keeps the head and tail of s within max bytes, on rune
// boundaries, marking what was dropped.
func cutText(s string, max int) (string, bool) {
	if len(s) <= max {
		return s, false
	}
	half := max / 2
	head, tail := s[:half], s[len(s)-half:]
	return strings.ToValidUTF8(head, "") + fmt.Sprintf("\n[… truncated %d of %d bytes …]\n", len(s)-2*half, len(s)) + strings.ToValidUTF8(tail, ""), true
}

// Known MIME types of rich output. Others are dropped while decoding:
// nothing downstream shows them.
var knownMIME = map[string]bool{
	"text/plain": true, "text/html": true, "text/markdown": true, "text/latex": true,
	"image/svg+xml": true, "application/json": true, NoteMIME: true,
	"image/png": true, "image/jpeg": true, "image/gif": true, "image/webp": true,
}

// NoteMIME carries the driver's notes about a bundle (a representation it
// dropped).
const NoteMIME = "text/x-kiln-note"

func binaryMIME(mime string) bool {
	return strings.HasPrefix(mime, "image/") && mime != "image/svg+xml"
}

// validBase64 checks standard base64 without holding its decoded form.
func validBase64(s string) bool {
	if len(s)%4 != 0 {
		return false
	}
	var buf [3 * 1024]byte
	for len(s) > 0 {
		n := min(len(s), 4*1024)
		if n < len(s) && strings.IndexByte(s[:n], '=') >= 0 {
			return false // padding before the end
		}
		if _, err := base64.StdEncoding.Decode(buf[:], []byte(s[:n])); err != nil {
			return false
		}
		s = s[n:]
	}
	return true
}

// MaxAnswer is the longest frame an honest agent can send in answer to r:
// kept output at its worst escaping (a control character costs six bytes
// encoded), rich output within MaxRich, cut exception text, file data as
// base64, a full listing, and an error message that may quote the path.
// The host refuses longer frames unread (ReadFrameMax).
func (r *Request) MaxAnswer() int {
	const slack = 64 << 10
	msg := 6 * (MaxMessage + len(r.Path))
	switch r.Op {
	case OpPython, OpShell:
		out := r.MaxOutput
		if out <= 0 {
			out = DefaultMaxOutput
		}
		return min(MaxFrame, 2*6*3*out+MaxRich+MaxDisplays*1024+2*6*MaxMessage+msg+slack)
	case OpSaveState, OpLoadState:
		return min(MaxFrame, 2*MaxStateNames*(6*MaxStateEntry+8)+msg+slack)
	case OpRead, OpReadState:
		n := int64(MaxRead)
		if r.MaxBytes > 0 {
			n = min(n, r.MaxBytes)
		}
		return min(MaxFrame, int(n+2)/3*4+msg+slack)
	case OpList, OpChanges:
		return min(MaxFrame, MaxListEntries*(6*maxPath+128)+msg+slack)
	}
	return msg + slack
}

// checkOutput validates a progress frame: only for a running exec request
// that asked for one, with nothing else in it, its tail within
// MaxLiveTail (decoding already made it valid UTF-8).
func (r *Response) checkOutput(req *Request) error {
	exec := req.Op == OpPython || req.Op == OpShell
	switch {
	case !exec || !req.Live:
		return faultf("output frame for a %s request that asked for none", req.Op)
	case r.Error != "" || r.Exec != nil || len(r.Data) > 0 || r.Size != 0 || len(r.Files) > 0:
		return faultf("output frame carries an answer")
	case len(r.Output.Tail) > MaxLiveTail:
		return faultf("output frame: tail of %d bytes, at most %d", len(r.Output.Tail), MaxLiveTail)
	case r.Output.Total < int64(len(r.Output.Tail)):
		return faultf("output frame: total %d under its tail of %d bytes", r.Output.Total, len(r.Output.Tail))
	}
	return nil
}
