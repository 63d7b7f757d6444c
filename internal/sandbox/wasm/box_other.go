//go:build !linux

package wasm

import (
	"os/exec"

	"kiln/internal/sandbox"
)

// platform holds nothing off Linux: boxes get no cgroup, only V8's heap
// cap and Pyodide's memory cap.
type platform struct{}

func (p *platform) init(b *Backend) error { return nil }

func (p *platform) notes() []string {
	return []string{"no cgroup off Linux: only V8's heap cap and Pyodide's memory cap bound a box"}
}

func (p *platform) close() error          { return nil }
func (p *platform) prepare(cmd *exec.Cmd) {}

type boxControl struct{ cmd *exec.Cmd }

func (p *platform) start(cmd *exec.Cmd, id string, l sandbox.Limits) (boxControl, error) {
	if err := cmd.Start(); err != nil {
		return boxControl{}, err
	}
	return boxControl{cmd: cmd}, nil
}

func (c boxControl) kill() {
	if c.cmd != nil && c.cmd.Process != nil {
		c.cmd.Process.Kill()
	}
}

func (c boxControl) release() error  { return nil }
func (c boxControl) oomKills() int64 { return -1 }
