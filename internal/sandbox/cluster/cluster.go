// Package cluster spreads boxes over many hosts: kiln node, a daemon on
// each host, makes boxes with a node-local backend (the jail, gVisor, a
// microVM) and serves them to front servers, and the cluster backend of a
// front (kiln mcp or serve --backend cluster) places each new box on a
// node and talks to its agent through the node.
//
// A front connects to a node once per box, over TLS with certificates on
// both ends from one CA of the operator's (kiln node certs): a node serves
// only a client whose certificate the CA signed for client use, and a
// front talks only to a server whose certificate the CA signed for server
// use under the name NodeServerName. A box never holds either, and the
// node's boxes have no network, so no box can reach a node as a front.
//
// On the connection the front first writes one Open frame. The node
// answers with its Status; for a status that is all, and it closes the
// connection. For a box, it makes one within its own limits and then
// sends the box's agent hello (or why it could not make one);
// from then on the connection carries the agent protocol (agentproto), the
// node relaying each of the front's requests to the box as one of its own
// and each answer back under the front's request ID. Both ends validate
// every frame from the box, the node first. Closing the connection
// destroys the box; a box that dies closes the connection.
//
// A front binds a session's box to the session (agentproto.OpBind, with a
// digest of its key: no node learns a principal or a session name). A
// bound box whose front's connection ends without unbinding it (a front
// killed or cut off) is kept for the node's orphan grace, and any front
// may take it over with OpAdopt: the session goes on in the same kernel,
// through whichever front its client reaches. A front that adopts a box
// another front still holds takes it from that front, whose connection
// the node closes.
package cluster

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"kiln/internal/sandbox"
)

// Open is a front's first frame on a connection to a node.
type Open struct {
	Op string `json:"op"` // OpCreate or OpStatus
	// Limits are what the front asks of the box; the node holds them
	// within its own (sandbox.Limits.Within).
	Limits sandbox.Limits `json:"limits"`
	// Urgent is sandbox.Spec.Urgent: a call waits for the box.
	Urgent bool `json:"urgent,omitempty"`
	// Key is the session key digest (SessionKey) of OpAdopt, and of an
	// OpStatus that asks whether the node holds that session's box.
	Key string `json:"key,omitempty"`
}

// Open operations.
const (
	OpCreate = "create"
	OpStatus = "status"
	// OpAdopt takes over the box bound to Key: the node answers its
	// status with Holds, then, if it holds the box, the box's hello.
	OpAdopt = "adopt"
)

// Status is a node's first answer on every connection: what placement
// weighs, and which run of the node it is.
type Status struct {
	// Node names this run of the node, random at its start: a front
	// that finds another name at the same address after losing a box
	// knows that the node restarted, and every box with it.
	Node     string `json:"node"`
	Backend  string `json:"backend"`
	Boxes    int    `json:"boxes"`     // live boxes the node made for fronts
	MaxBoxes int    `json:"max_boxes"` // the node's cap; a node at it refuses OpCreate
	// Holds answers an Open with a Key: the node holds a box bound to it.
	Holds bool `json:"holds,omitempty"`
}

// maxOpenFrame bounds the frames before the agent protocol: an Open, a
// Status.
const maxOpenFrame = 64 << 10

// Free is the share of the node's boxes still to be had, 0 when full.
func (s Status) Free() float64 {
	if s.MaxBoxes <= 0 || s.Boxes >= s.MaxBoxes {
		return 0
	}
	return float64(s.MaxBoxes-s.Boxes) / float64(s.MaxBoxes)
}

// SessionKey is what a node is told of a session key
// (sandbox.Adopter's): a digest, 64 hex digits.
func SessionKey(key string) string {
	h := sha256.Sum256([]byte("kiln-session\x00" + key))
	return hex.EncodeToString(h[:])
}

// validKey says that k is a SessionKey.
func validKey(k string) bool {
	if len(k) != 2*sha256.Size {
		return false
	}
	for _, c := range []byte(k) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func (o *Open) check() error {
	if o.Key != "" && (!validKey(o.Key) || o.Op == OpCreate) || o.Op == OpAdopt && o.Key == "" {
		return fmt.Errorf("a malformed session key (%d bytes)", len(o.Key))
	}
	switch o.Op {
	case OpCreate, OpStatus, OpAdopt:
		return nil
	case "":
		return errors.New("the open frame names no operation")
	default:
		return fmt.Errorf("unknown operation %q", o.Op)
	}
}

func (s *Status) check() error {
	if s.Boxes < 0 || s.MaxBoxes < 0 || len(s.Backend) > 64 || s.Node == "" || len(s.Node) > 64 {
		return fmt.Errorf("a malformed status (%d of %d boxes, backend %.64q)", s.Boxes, s.MaxBoxes, s.Backend)
	}
	return nil
}
