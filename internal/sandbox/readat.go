package sandbox

import (
	"context"
	"errors"
	"fmt"

	"kiln/internal/agentproto"
)

// RangeReader is a box that can read a file from an offset, so that a
// file larger than one read (agentproto.MaxRead) can be read in pieces.
// It is separate from Sandbox because a backend that implements the
// operations itself need not offer it; callers fall back to ReadFile.
type RangeReader interface {
	// ReadFileAt returns at most max bytes of the file from offset off,
	// and the file's full size.
	ReadFileAt(ctx context.Context, path string, off, max int64) (data []byte, size int64, err error)
}

var _ RangeReader = (*AgentConn)(nil)

// ErrNoRangedRead is an agent that answered a ranged read from the start
// of the file: it predates ranged reads.
var ErrNoRangedRead = errors.New("this sandbox cannot read a file from an offset (an agent older than ranged reads: rebuild its image)")

func (c *AgentConn) ReadFileAt(ctx context.Context, path string, off, max int64) ([]byte, int64, error) {
	if off < 0 {
		return nil, 0, fmt.Errorf("reading %s: offset %d is negative", path, off)
	}
	resp, err := c.call(ctx, agentproto.Request{Op: agentproto.OpRead, Path: path, Offset: off, MaxBytes: max})
	if err != nil {
		return nil, 0, err
	}
	if resp.Offset != off {
		return nil, 0, ErrNoRangedRead
	}
	return resp.Data, resp.Size, nil
}
