package mcpserver

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"sync"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// StdioTransport is newline-delimited JSON-RPC over a reader and a writer
// (stdin and stdout) that survives a broken client: a line that is not a
// JSON-RPC message gets a JSON-RPC error answer (-32700 or -32600) and the
// connection goes on. The SDK's StdioTransport ends the session at the
// first such line, which would let one bad line take the server down.
// The error answer carries the request's id whenever it can be read from
// the line, even from one too long to keep, so a client waiting on that id
// is answered instead of hanging.
type StdioTransport struct {
	In  io.Reader
	Out io.Writer
}

var _ mcp.Transport = (*StdioTransport)(nil)

// NewStdioTransport returns a transport on in and out.
func NewStdioTransport(in io.Reader, out io.Writer) *StdioTransport {
	return &StdioTransport{In: in, Out: out}
}

// Connect starts reading lines.
func (t *StdioTransport) Connect(context.Context) (mcp.Connection, error) {
	c := &lineConn{w: t.Out, msgs: make(chan readResult), closed: make(chan struct{})}
	go c.readLoop(bufio.NewReaderSize(t.In, 64<<10))
	return c, nil
}

type readResult struct {
	msg jsonrpc.Message
	err error
}

type lineConn struct {
	w         io.Writer
	wmu       sync.Mutex
	msgs      chan readResult
	closed    chan struct{}
	closeOnce sync.Once
}

func (c *lineConn) readLoop(r *bufio.Reader) {
	for {
		line, tail, tooLong, err := readLine(r)
		if len(bytes.TrimSpace(line)) > 0 || tooLong {
			if msg, perr := decodeLine(line, tail, tooLong); perr != nil {
				c.writeRaw(perr)
			} else if !c.deliver(readResult{msg: msg}) {
				return
			}
		}
		if err != nil {
			c.deliver(readResult{err: err})
			return
		}
	}
}

func (c *lineConn) deliver(r readResult) bool {
	select {
	case c.msgs <- r:
		return true
	case <-c.closed:
		return false
	}
}

// idWindow is how much of the start and of the end of a line too long to
// keep is kept, to find the request's id in.
const idWindow = 4 << 10

// readLine reads up to '\n', keeping at most maxMessageBytes bytes. When
// the line is longer (tooLong), line holds its first idWindow bytes and
// tail its last idWindow bytes, and the rest is dropped.
func readLine(r *bufio.Reader) (line, tail []byte, tooLong bool, err error) {
	for {
		chunk, err := r.ReadSlice('\n')
		switch {
		case tooLong:
			tail = keepTail(tail, chunk)
		case len(line)+len(chunk) > maxMessageBytes:
			tooLong = true
			tail = keepTail(bytes.Clone(line[max(0, len(line)-idWindow):]), chunk)
			line = bytes.Clone(line[:min(len(line), idWindow)])
		default:
			line = append(line, chunk...)
		}
		if err != bufio.ErrBufferFull {
			return line, tail, tooLong, err
		}
	}
}

// keepTail appends chunk to tail and keeps the last idWindow bytes.
func keepTail(tail, chunk []byte) []byte {
	tail = append(tail, chunk...)
	if len(tail) > idWindow {
		tail = append(tail[:0], tail[len(tail)-idWindow:]...)
	}
	return tail
}

// decodeLine returns the message on line, or the JSON-RPC error response
// to send instead. For a line too long to keep, line and tail are its
// start and end.
func decodeLine(line, tail []byte, tooLong bool) (jsonrpc.Message, []byte) {
	if tooLong {
		return nil, errorResponse(findID(line, tail), jsonrpc.CodeInvalidRequest, fmt.Sprintf("message longer than %d bytes", maxMessageBytes))
	}
	msg, err := jsonrpc.DecodeMessage(bytes.TrimSpace(line))
	if err == nil {
		return msg, nil
	}
	id := findID(line, line[max(0, len(line)-idWindow):])
	if !json.Valid(line) {
		return nil, errorResponse(id, jsonrpc.CodeParseError, "parse error: "+err.Error())
	}
	return nil, errorResponse(id, jsonrpc.CodeInvalidRequest, "invalid request: "+err.Error())
}

// findID returns the id of the request a line of JSON starts with (head)
// and ends with (tail), or nil. The line may be cut or malformed, so it
// reads the top-level members of head in order up to the first it cannot
// read, then looks for an id as the last member of the object at the end
// of tail (where the TypeScript SDK puts it).
func findID(head, tail []byte) any {
	if id := idInHead(head); id != nil {
		return id
	}
	if m := tailID.FindSubmatch(tail); m != nil {
		return jsonID(m[1])
	}
	return nil
}

// tailID matches an id that is the last member of the object the text
// ends with.
var tailID = regexp.MustCompile(`"id"\s*:\s*(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|"(?:[^"\\]|\\.)*")\s*}\s*$`)

func idInHead(head []byte) any {
	dec := json.NewDecoder(bytes.NewReader(head))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil
	}
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return nil
		}
		if key == "id" {
			var raw json.RawMessage
			if dec.Decode(&raw) != nil {
				return nil
			}
			return jsonID(raw)
		}
		if skipValue(dec) != nil {
			return nil
		}
	}
	return nil
}

// skipValue reads one JSON value token by token, so that a value cut
// short fails without being buffered whole.
func skipValue(dec *json.Decoder) error {
	depth := 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		switch tok {
		case json.Delim('{'), json.Delim('['):
			depth++
		case json.Delim('}'), json.Delim(']'):
			depth--
		}
		if depth == 0 {
			return nil
		}
	}
}

// jsonID returns raw as a JSON-RPC id (a string or a number, kept as
// written), or nil.
func jsonID(raw []byte) any {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var id any
	if dec.Decode(&id) != nil {
		return nil
	}
	switch id.(type) {
	case string, json.Number:
		return id
	}
	return nil
}

func errorResponse(id any, code int, msg string) []byte {
	b, _ := json.Marshal(map[string]any{
		"jsonrpc": "2.0",
		"id":      id,
		"error":   map[string]any{"code": code, "message": msg},
	})
	return b
}

func (c *lineConn) writeRaw(b []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_, err := c.w.Write(append(b, '\n'))
	return err
}

func (c *lineConn) Read(ctx context.Context) (jsonrpc.Message, error) {
	select {
	case r := <-c.msgs:
		return r.msg, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-c.closed:
		return nil, io.EOF
	}
}

func (c *lineConn) Write(ctx context.Context, msg jsonrpc.Message) error {
	select {
	case <-c.closed:
		return errors.New("connection closed")
	default:
	}
	b, err := jsonrpc.EncodeMessage(msg)
	if err != nil {
		return fmt.Errorf("encoding message: %w", err)
	}
	return c.writeRaw(b)
}

func (c *lineConn) Close() error {
	c.closeOnce.Do(func() { close(c.closed) })
	return nil
}

func (c *lineConn) SessionID() string { return "" }
