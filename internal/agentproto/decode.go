package agentproto

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"
)

// maxDepth bounds the nesting of a frame; kiln's frames nest four deep.
const maxDepth = 32

// checkShape refuses a frame with an array or object of more than
// MaxItems members, or nested deeper than maxDepth, before anything is
// decoded. It does not validate the JSON; the decoder does that.
func checkShape(b []byte) error {
	var commas [maxDepth + 1]int
	depth := 0
	inStr, esc := false, false
	for _, c := range b {
		if inStr {
			switch {
			case esc:
				esc = false
			case c == '\\':
				esc = true
			case c == '"':
				inStr = false
			}
			continue
		}
		switch c {
		case '"':
			inStr = true
		case '[', '{':
			if depth++; depth > maxDepth {
				return faultf("frame nested deeper than %d", maxDepth)
			}
			commas[depth] = 0
		case ']', '}':
			depth = max(depth-1, 0)
		case ',':
			if commas[depth]++; commas[depth] >= MaxItems {
				return faultf("frame has a list of more than %d entries", MaxItems)
			}
		}
	}
	return nil
}

// rawValue keeps a JSON value undecoded. It refers into the frame's
// buffer, so it is only used while that frame is being decoded.
type rawValue []byte

func (r *rawValue) UnmarshalJSON(b []byte) error {
	*r = b
	return nil
}

func (r rawValue) null() bool { return len(r) == 0 || string(r) == "null" }

// UnmarshalJSON decodes an ExecResult with its rich output bounded by
// MaxRich: representations are decoded in order, the result first, then
// the displays, and those beyond the budget are never materialized; a
// note says how much was dropped. Representations of unknown MIME types
// are dropped, and images that are not valid base64 are dropped with a
// note.
func (e *ExecResult) UnmarshalJSON(b []byte) error {
	type plain ExecResult // without this method
	*e = ExecResult{}
	var w struct {
		*plain
		Result   rawValue   `json:"result"`
		Displays []rawValue `json:"displays"`
	}
	w.plain = (*plain)(e)
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	rb := richBudget{left: MaxRich}
	var err error
	if e.Result, err = rb.bundle(w.Result); err != nil {
		return fmt.Errorf("result: %w", err)
	}
	if len(e.Notes) == 0 {
		e.Notes = nil // as it encodes
	}
	if len(w.Displays) > 0 {
		e.Displays = make([]MimeBundle, len(w.Displays))
	}
	for i, d := range w.Displays {
		if e.Displays[i], err = rb.bundle(d); err != nil {
			return fmt.Errorf("display %d: %w", i, err)
		}
	}
	e.Notes = append(e.Notes, rb.notes()...)
	return nil
}

// richBudget decodes representations until MaxRich bytes are spent.
type richBudget struct {
	left, dropped, total int
	badImages            int
}

func (rb *richBudget) bundle(raw rawValue) (MimeBundle, error) {
	if raw.null() {
		return nil, nil
	}
	var reprs map[string]rawValue
	if err := json.Unmarshal(raw, &reprs); err != nil {
		return nil, err
	}
	var out MimeBundle
	for _, mime := range bundleOrder(reprs) {
		v := reprs[mime]
		if !knownMIME[mime] || v.null() {
			continue
		}
		if v[0] != '"' {
			return nil, fmt.Errorf("%s representation is not a string", mime)
		}
		rb.total += len(v)
		if len(v) > rb.left {
			rb.dropped += len(v)
			continue
		}
		rb.left -= len(v)
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			return nil, err
		}
		if binaryMIME(mime) && !validBase64(s) {
			rb.badImages++
			continue
		}
		if out == nil {
			out = MimeBundle{}
		}
		out[mime] = s
	}
	return out, nil
}

func (rb *richBudget) notes() []string {
	var n []string
	if rb.dropped > 0 {
		n = append(n, RichDroppedNote(rb.dropped, rb.total))
	}
	if rb.badImages > 0 {
		n = append(n, fmt.Sprintf("%d image representation(s) dropped: not valid base64", rb.badImages))
	}
	return n
}

// RichDroppedNote says how much rich output was dropped over MaxRich.
func RichDroppedNote(dropped, total int) string {
	return fmt.Sprintf("dropped %d of %d bytes of rich output (at most %d MiB per call)", dropped, total, MaxRich>>20)
}

// bundleOrder is the order in which a bundle's representations spend the
// budget: the plain text and the notes first, the rest by name.
func bundleOrder[V any](b map[string]V) []string {
	keys := make([]string, 0, len(b))
	for k := range b {
		keys = append(keys, k)
	}
	rank := func(k string) int {
		switch k {
		case "text/plain":
			return 0
		case NoteMIME:
			return 1
		}
		return 2
	}
	sort.Slice(keys, func(i, j int) bool {
		if ri, rj := rank(keys[i]), rank(keys[j]); ri != rj {
			return ri < rj
		}
		return keys[i] < keys[j]
	})
	return keys
}

// Bound applies the host's bounds to a result already in memory, the way
// the host's decoder and Check would, so that an honest agent's frame
// never needs the host's cuts: rich output within MaxRich (as encoded),
// at most MaxDisplays displays, an exception's text within MaxMessage.
// The agent calls it on what its kernel answered: the driver keeps to the
// bounds, but a cell writing to the driver's fd 4 need not.
func (e *ExecResult) Bound() {
	rb := richBudget{left: MaxRich}
	limit := func(b MimeBundle) MimeBundle {
		if b == nil {
			return nil
		}
		var out MimeBundle
		for _, mime := range bundleOrder(b) {
			v := b[mime]
			if !knownMIME[mime] {
				continue
			}
			n := encodedLen(v)
			rb.total += n
			if n > rb.left {
				rb.dropped += n
				continue
			}
			rb.left -= n
			if out == nil {
				out = MimeBundle{}
			}
			out[mime] = v
		}
		return out
	}
	e.Result = limit(e.Result)
	if n := len(e.Displays); n > MaxDisplays {
		e.Displays = e.Displays[:MaxDisplays:MaxDisplays]
		e.Notes = append(e.Notes, fmt.Sprintf("dropped %d of %d displays (at most %d per call)", n-MaxDisplays, n, MaxDisplays))
	}
	for i := range e.Displays {
		e.Displays[i] = limit(e.Displays[i])
	}
	e.Notes = append(e.Notes, rb.notes()...)
	if err := e.Error; err != nil {
		var c0, c1, c2 bool
		if len(err.Name) > maxShort {
			err.Name, c0 = strings.ToValidUTF8(err.Name[:maxShort], ""), true
		}
		err.Value, c1 = cutText(err.Value, MaxMessage)
		err.Traceback, c2 = cutText(err.Traceback, MaxMessage)
		if c0 || c1 || c2 {
			e.Notes = append(e.Notes, fmt.Sprintf("the exception's text was cut to %d bytes", MaxMessage))
		}
	}
}

// encodedLen is the length of s as a JSON string, as WriteFrame encodes
// it: quotes, escapes, and \ufffd for each invalid byte.
func encodedLen(s string) int {
	n := 2
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\' || c == '\n' || c == '\r' || c == '\t':
				n += 2
			case c < 0x20:
				n += 6
			default:
				n++
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1, r == '\u2028', r == '\u2029':
			n += 6
		default:
			n += size
		}
		i += size
	}
	return n
}
