package mcpserver

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// maxLine bounds one inbound message, as the SDK's own stdio transport does.
const maxLine = 16 << 20

// StdioTransport is newline-delimited JSON-RPC over a reader and a writer
// (stdin and stdout) that survives a broken client: a line that is not a
// JSON-RPC message gets a JSON-RPC error answer (-32700 or -32600) and the
// connection goes on. The SDK's StdioTransport ends the session at the
// first such line, which would let one bad line take the server down.
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
		line, tooLong, err := readLine(r)
		if len(bytes.TrimSpace(line)) > 0 || tooLong {
			if msg, perr := decodeLine(line, tooLong); perr != nil {
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

// readLine reads up to '\n', keeping at most maxLine bytes; tooLong says
// bytes were dropped.
func readLine(r *bufio.Reader) (line []byte, tooLong bool, err error) {
	for {
		chunk, err := r.ReadSlice('\n')
		if len(line)+len(chunk) > maxLine {
			tooLong = true
		} else {
			line = append(line, chunk...)
		}
		if err != bufio.ErrBufferFull {
			return line, tooLong, err
		}
	}
}

// decodeLine returns the message on line, or the JSON-RPC error response
// to send instead.
func decodeLine(line []byte, tooLong bool) (jsonrpc.Message, []byte) {
	if tooLong {
		return nil, errorResponse(nil, jsonrpc.CodeInvalidRequest, fmt.Sprintf("message longer than %d bytes", maxLine))
	}
	msg, err := jsonrpc.DecodeMessage(bytes.TrimSpace(line))
	if err == nil {
		return msg, nil
	}
	var probe struct {
		ID json.RawMessage `json:"id"`
	}
	if json.Unmarshal(line, &probe) != nil {
		return nil, errorResponse(nil, jsonrpc.CodeParseError, "parse error: "+err.Error())
	}
	var id any
	if json.Unmarshal(probe.ID, &id) == nil {
		switch id.(type) {
		case string, float64:
		default:
			id = nil
		}
	}
	return nil, errorResponse(id, jsonrpc.CodeInvalidRequest, "invalid request: "+err.Error())
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
