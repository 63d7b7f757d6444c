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
	// Destroyed once the result is in hand, off the call's path.
	defer m.destroy(box)
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

// destroy closes a used box in the background; Close waits for it.
func (m *Manager) destroy(box sandbox.Sandbox) {
	m.destroying.Add(1)
	go func() {
		defer m.destroying.Done()
		box.Close()
	}()
}
