//go:build !linux

package wasm

import (
	"context"
	"os"
	"os/exec"

	"kiln/internal/sandbox"
)

// MaybeInit does nothing off Linux.
func MaybeInit() {}

// platform holds nothing off Linux: boxes get no cgroup, only V8's heap
// cap and Pyodide's memory cap.
type platform struct{ b *Backend }

func (p *platform) init(b *Backend) error { p.b = b; return nil }

func (p *platform) notes() []string {
	return []string{"no cgroup off Linux: only V8's heap cap and Pyodide's memory cap bound a box"}
}

func (p *platform) close() error { return nil }

// command returns the deno command, unconfined: off Linux only Deno's
// permissions bound it.
func (p *platform) command(host paths, args func(paths) []string) (*exec.Cmd, []*os.File, error) {
	cmd := exec.Command(host.deno, args(host)...)
	cmd.Env = p.b.env(host.host)
	cmd.Dir = host.host
	return cmd, nil, nil
}

func (p *platform) run(ctx context.Context, cmd *exec.Cmd) error {
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			cmd.Process.Kill()
		case <-done:
		}
	}()
	err := cmd.Wait()
	close(done)
	return err
}

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
