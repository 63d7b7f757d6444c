package session

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// Language selects the interpreter of a call.
type Language int

const (
	Python Language = iota
	Shell
)

// Produced is a file a per-call run created or changed in its workspace.
type Produced struct {
	// Path is the file's path, safe to print: a name with control or
	// other non-printing characters, or not UTF-8, is Go-quoted.
	Path string
	Size int64
	Data []byte // nil when not returned; Skipped says why
	// Skipped says why Data is nil: "too large to return", "not a regular
	// file: fifo", ….
	Skipped string
}

// specialKinds names the kinds of non-regular files the agent reports;
// what the box says is never printed as it is.
var specialKinds = map[string]string{
	"fifo":        "fifo",
	"socket":      "socket",
	"device":      "device",
	"char-device": "character device",
}

// printablePath returns p as it is if every character prints, or else
// Go-quoted, so a file name cannot inject escape sequences or lines into
// a result.
func printablePath(p string) string {
	if !utf8.ValidString(p) || strings.IndexFunc(p, func(r rune) bool { return !strconv.IsPrint(r) }) >= 0 {
		return strconv.Quote(p)
	}
	return p
}

// Per-call caps on what comes back.
const (
	maxProducedFiles = 32
	maxProducedBytes = 4 << 20
)

// RunOnce runs one call in a never-used box, stages files into its
// workspace first, collects what the call wrote, and destroys the box.
func (m *Manager) RunOnce(ctx context.Context, lang Language, code string, files map[string][]byte, timeout time.Duration) (out *Outcome, _ []Produced, err error) {
	defer func() { m.observeExec(ctx, principalOf(ctx), "", lang, code, out, err) }()
	box, err := m.getBox(ctx)
	if errors.Is(err, ErrBusy) {
		return nil, nil, err
	}
	if err != nil {
		return nil, nil, fmt.Errorf("starting sandbox: %w", err)
	}
	// Destroyed once the result is in hand, off the call's path, or by
	// Close if the call is still stuck in it then.
	defer m.destroy(box)
	if !m.running(box) {
		return nil, nil, ErrShutdown
	}
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		if err := box.WriteFile(ctx, p, files[p]); err != nil {
			return nil, nil, fmt.Errorf("staging %s: %w", p, err)
		}
	}
	// The workspace of a never-used box holds only what was staged; a
	// file the call created or changed is one not in this list as it is.
	staged := map[string]agentproto.FileInfo{}
	if len(paths) > 0 {
		list, err := box.Changes(ctx, time.Unix(0, 0))
		if err != nil {
			return nil, nil, fmt.Errorf("listing staged files: %w", err)
		}
		for _, f := range list {
			staged[f.Path] = f
		}
	}
	out, err = m.runBounded(ctx, box, timeout, func(ctx context.Context, box sandbox.Sandbox) (*agentproto.ExecResult, error) {
		if lang == Shell {
			return box.RunShell(ctx, code, sandbox.ExecOptions{MaxOutput: m.opts.MaxOutput})
		}
		return box.RunPython(ctx, code, sandbox.ExecOptions{MaxOutput: m.opts.MaxOutput})
	})
	if err != nil || out.Restarted {
		return out, nil, err
	}
	out.Fresh = true
	all, err := box.Changes(ctx, time.Unix(0, 0))
	if err != nil {
		return out, nil, nil
	}
	var changed []agentproto.FileInfo
	for _, f := range all {
		if s, ok := staged[f.Path]; ok && s.Size == f.Size && s.ModNano == f.ModNano {
			continue
		}
		changed = append(changed, f)
	}
	var produced []Produced
	budget := int64(maxProducedBytes)
	for i, f := range changed {
		if i >= maxProducedFiles {
			out.Note = joinNote(out.Note, fmt.Sprintf("%d more changed files not listed", len(changed)-i))
			break
		}
		p := Produced{Path: printablePath(f.Path), Size: f.Size}
		switch {
		case f.Special != "":
			p.Skipped = "not a regular file: " + cmp.Or(specialKinds[f.Special], "special file")
		case f.Size > budget:
			p.Skipped = "too large to return"
		default:
			data, _, err := box.ReadFile(ctx, f.Path, f.Size)
			if err != nil {
				p.Skipped = "could not be read"
				break
			}
			p.Data = append([]byte{}, data...) // an empty file is returned, empty
			budget -= int64(len(data))
		}
		produced = append(produced, p)
	}
	return out, produced, nil
}

// running records a per-call box in use, for Close to destroy; false if
// the manager is closed.
func (m *Manager) running(box sandbox.Sandbox) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false
	}
	m.calls[box] = struct{}{}
	return true
}

// destroy closes a used box in the background; Close waits for it.
func (m *Manager) destroy(box sandbox.Sandbox) {
	m.mu.Lock()
	delete(m.calls, box)
	closed := m.closed
	if !closed {
		m.destroying.Add(1)
	}
	m.mu.Unlock()
	if closed {
		box.Close() // Close is waiting for nothing more
		return
	}
	go func() {
		defer m.destroying.Done()
		box.Close()
	}()
}
