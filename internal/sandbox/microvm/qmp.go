package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// qmp is a small typed client of the QEMU Machine Protocol: one command at
// a time, asynchronous events kept aside. QMP is line-delimited JSON: a
// greeting, then {"execute":…} answered by {"return":…} or {"error":…},
// with {"event":…} lines interleaved.
type qmp struct {
	rw  io.ReadWriteCloser
	dec *json.Decoder

	mu     sync.Mutex // one command at a time
	events []qmpEvent
}

type qmpEvent struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
}

// QMPError is an error QEMU returned for a command.
type QMPError struct {
	Command string
	Class   string `json:"class"`
	Desc    string `json:"desc"`
}

func (e *QMPError) Error() string { return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc) }

type qmpReply struct {
	Return json.RawMessage `json:"return"`
	Error  *QMPError       `json:"error"`
	Event  string          `json:"event"`
	Data   json.RawMessage `json:"data"`
	QMP    json.RawMessage `json:"QMP"`
}

// dialQMP reads the greeting on rw and negotiates capabilities. ctx bounds
// the handshake: rw is closed if it ends first.
func dialQMP(ctx context.Context, rw io.ReadWriteCloser) (*qmp, error) {
	q := &qmp{rw: rw, dec: json.NewDecoder(bufio.NewReader(rw))}
	stop := context.AfterFunc(ctx, func() { rw.Close() })
	defer stop()
	var greet qmpReply
	if err := q.dec.Decode(&greet); err != nil {
		return nil, fmt.Errorf("reading qmp greeting: %w", errors.Join(err, ctx.Err()))
	}
	if greet.QMP == nil {
		return nil, errors.New("reading qmp greeting: not a QMP greeting")
	}
	if err := q.run(ctx, "qmp_capabilities", nil, nil); err != nil {
		return nil, err
	}
	return q, nil
}

// run executes cmd with args and decodes its return value into result
// (which may be nil). If ctx ends first the connection is closed, so later
// calls fail too: a QMP stream cannot resynchronize mid-command.
func (q *qmp) run(ctx context.Context, cmd string, args, result any) error {
	return q.runWithFD(ctx, cmd, args, result, nil)
}

// fdWriter is a connection that can pass file descriptors (a unix socket).
type fdWriter interface {
	WriteMsgUnix(b, oob []byte, addr *net.UnixAddr) (n, oobn int, err error)
}

// runWithFD is run with the descriptor of f passed alongside the command,
// as getfd and add-fd want.
func (q *qmp) runWithFD(ctx context.Context, cmd string, args, result any, f *os.File) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	req := struct {
		Execute   string `json:"execute"`
		Arguments any    `json:"arguments,omitempty"`
	}{cmd, args}
	b, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("encoding qmp %s: %w", cmd, err)
	}
	stop := context.AfterFunc(ctx, func() { q.rw.Close() })
	defer stop()
	if f != nil {
		uc, ok := q.rw.(fdWriter)
		if !ok {
			return fmt.Errorf("sending qmp %s: connection cannot pass descriptors", cmd)
		}
		if _, _, err := uc.WriteMsgUnix(append(b, '\n'), unix.UnixRights(int(f.Fd())), nil); err != nil {
			return fmt.Errorf("sending qmp %s: %w", cmd, errors.Join(err, ctx.Err()))
		}
	} else if _, err := q.rw.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("sending qmp %s: %w", cmd, errors.Join(err, ctx.Err()))
	}
	for {
		var r qmpReply
		if err := q.dec.Decode(&r); err != nil {
			return fmt.Errorf("reading qmp %s: %w", cmd, errors.Join(err, ctx.Err()))
		}
		switch {
		case r.Event != "":
			q.events = append(q.events, qmpEvent{r.Event, r.Data})
		case r.Error != nil:
			r.Error.Command = cmd
			return r.Error
		case r.Return != nil:
			if result == nil {
				return nil
			}
			if err := json.Unmarshal(r.Return, result); err != nil {
				return fmt.Errorf("decoding qmp %s: %w", cmd, err)
			}
			return nil
		}
	}
}

// Events returns and forgets the events seen so far.
func (q *qmp) Events() []qmpEvent {
	q.mu.Lock()
	defer q.mu.Unlock()
	ev := q.events
	q.events = nil
	return ev
}

func (q *qmp) Close() error { return q.rw.Close() }

// Typed commands kiln uses.

type migrationCap struct {
	Capability string `json:"capability"`
	State      bool   `json:"state"`
}

func (q *qmp) setMigrationCaps(ctx context.Context, caps ...string) error {
	var cs []migrationCap
	for _, c := range caps {
		cs = append(cs, migrationCap{c, true})
	}
	return q.run(ctx, "migrate-set-capabilities", map[string]any{"capabilities": cs}, nil)
}

// getfd hands QEMU a descriptor, named for later commands (migrate fd:name).
func (q *qmp) getfd(ctx context.Context, name string, f *os.File) error {
	return q.runWithFD(ctx, "getfd", map[string]any{"fdname": name}, nil, f)
}

func (q *qmp) migrate(ctx context.Context, uri string) error {
	return q.run(ctx, "migrate", map[string]any{"uri": uri}, nil)
}

func (q *qmp) migrateIncoming(ctx context.Context, uri string) error {
	return q.run(ctx, "migrate-incoming", map[string]any{"uri": uri}, nil)
}

type migrationInfo struct {
	Status    string `json:"status"`
	ErrorDesc string `json:"error-desc"`
}

func (q *qmp) queryMigrate(ctx context.Context) (migrationInfo, error) {
	var mi migrationInfo
	err := q.run(ctx, "query-migrate", nil, &mi)
	return mi, err
}

type statusInfo struct {
	Running bool   `json:"running"`
	Status  string `json:"status"`
}

func (q *qmp) queryStatus(ctx context.Context) (statusInfo, error) {
	var st statusInfo
	err := q.run(ctx, "query-status", nil, &st)
	return st, err
}

func (q *qmp) stop(ctx context.Context) error { return q.run(ctx, "stop", nil, nil) }
func (q *qmp) cont(ctx context.Context) error { return q.run(ctx, "cont", nil, nil) }
func (q *qmp) quit(ctx context.Context) error { return q.run(ctx, "quit", nil, nil) }
