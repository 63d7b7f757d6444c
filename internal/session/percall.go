package session

import (
	"context"
	"fmt"
	"sort"
	"time"

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
	Path string
	Size int64
	Data []byte // nil when over the cap
}

// Per-call caps on what comes back.
const (
	maxProducedFiles = 32
	maxProducedBytes = 4 << 20
)

// RunOnce runs one call in a never-used box, stages files into its
// workspace first, collects what the call wrote, and destroys the box.
func (m *Manager) RunOnce(ctx context.Context, lang Language, code string, files map[string][]byte, timeout time.Duration) (*Outcome, []Produced, error) {
	box, err := m.pool.Get(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("starting sandbox: %w", err)
	}
	defer box.Close()
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
	// Files staged above are older than mark; the call's own are not.
	mark := time.Now()
	time.Sleep(time.Millisecond)
	out, err := m.runBounded(ctx, box, timeout, func(ctx context.Context, box sandbox.Sandbox) (*agentproto.ExecResult, error) {
		if lang == Shell {
			return box.RunShell(ctx, code, sandbox.ExecOptions{MaxOutput: m.opts.MaxOutput})
		}
		return box.RunPython(ctx, code, sandbox.ExecOptions{MaxOutput: m.opts.MaxOutput})
	})
	if err != nil || out.Restarted {
		return out, nil, err
	}
	out.Fresh = true
	changed, err := box.Changes(ctx, mark)
	if err != nil {
		return out, nil, nil
	}
	var produced []Produced
	budget := int64(maxProducedBytes)
	for i, f := range changed {
		if i >= maxProducedFiles {
			out.Note = joinNote(out.Note, fmt.Sprintf("%d more changed files not listed", len(changed)-i))
			break
		}
		p := Produced{Path: f.Path, Size: f.Size}
		if f.Size <= budget {
			if data, _, err := box.ReadFile(ctx, f.Path, f.Size); err == nil {
				p.Data = data
				budget -= int64(len(data))
			}
		}
		produced = append(produced, p)
	}
	return out, produced, nil
}
