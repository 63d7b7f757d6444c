package cluster

import (
	"context"
	"errors"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// Abandon closes a box's connection as a front that dies would: without
// unbinding it first.
func Abandon(s sandbox.Sandbox) {
	s.(*box).AgentConn.Close()
}

// BindRaw sends a bind with key as it is, not a SessionKey of it.
func BindRaw(ctx context.Context, s sandbox.Sandbox, key string) error {
	resp, err := s.(*box).Forward(ctx, agentproto.Request{Op: agentproto.OpBind, Key: key}, nil)
	if err == nil && resp.Error != "" {
		err = errors.New(resp.Error)
	}
	return err
}

// OpenRaw sends open to the node at addr and reads its status.
func OpenRaw(ctx context.Context, b *Backend, addr string, open Open) error {
	c, _, err := b.dial(ctx, addr, open)
	if err == nil {
		c.Close()
	}
	return err
}
