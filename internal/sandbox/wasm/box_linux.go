package wasm

import (
	"fmt"
	"os/exec"
	"syscall"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// cgroupParent holds the cgroups of every kiln's wasm boxes; each box's
// group is named by its server's owner stamp, so a later kiln can sweep
// those of a server that died.
const cgroupParent = "/kiln-wasm"

// platform is what the backend holds on Linux: the host's cgroups, when
// kiln may write them.
type platform struct {
	b       *Backend
	cgroups *boxkit.Cgroups // nil without cgroups (not root)
	owner   string
	why     string // why boxes get no cgroup
}

func (p *platform) init(b *Backend) error {
	p.b = b
	p.owner = boxkit.Self().String()
	cg := boxkit.HostCgroups()
	if _, err := cg.CreateParent(cgroupParent); err != nil {
		p.why = fmt.Sprintf("no cgroup for wasm boxes (%v): only V8's heap cap and Pyodide's memory cap bound them", err)
		b.log.Warn("wasm boxes run without a cgroup", "err", err)
		return nil
	}
	p.cgroups = cg
	p.sweep()
	return nil
}

// sweep removes the box cgroups of kiln processes that are gone, killing
// what is still in them.
func (p *platform) sweep() {
	removed, err := p.cgroups.Sweep(cgroupParent, func(name string) bool {
		o, _, owned := boxkit.ParseOwner(name)
		return owned && !o.Alive()
	})
	for _, name := range removed {
		p.b.log.Info("removed a wasm box cgroup left by a dead kiln process", "cgroup", cgroupParent+"/"+name)
	}
	if err != nil {
		p.b.log.Warn("sweeping wasm cgroups", "err", err)
	}
}

func (p *platform) notes() []string {
	if p.why != "" {
		return []string{p.why}
	}
	return nil
}

func (p *platform) close() error {
	if p.cgroups != nil {
		p.cgroups.Group(cgroupParent).RemoveIfEmpty() // other kiln processes may use it
	}
	return nil
}

// prepare makes Deno die with its server and gives it a process group of
// its own.
func (p *platform) prepare(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// boxControl is a started box's process and cgroup.
type boxControl struct {
	cmd *exec.Cmd
	cg  *boxkit.CgroupGroup
}

// start starts cmd and puts it in a cgroup of its own, with the box's
// memory limit plus what Deno needs for itself.
func (p *platform) start(cmd *exec.Cmd, id string, l sandbox.Limits) (boxControl, error) {
	var c boxControl
	if p.cgroups != nil {
		g, err := p.cgroups.Create(cgroupParent+"/"+p.owner+"."+id, boxkit.CgroupLimits{
			MemoryBytes: l.MemoryBytes + heapMiB(l.MemoryBytes)<<20 + runtimeSlack,
			Pids:        runtimePids,
			CPUs:        l.CPUs,
		})
		if err != nil {
			return c, fmt.Errorf("creating the box's cgroup: %w", err)
		}
		c.cg = g
	}
	if err := cmd.Start(); err != nil {
		c.release()
		return c, err
	}
	c.cmd = cmd
	if c.cg != nil {
		if err := c.cg.Add(cmd.Process.Pid); err != nil {
			c.kill()
			cmd.Wait()
			c.release()
			return c, fmt.Errorf("moving deno into its cgroup: %w", err)
		}
	}
	return c, nil
}

func (c boxControl) kill() {
	if c.cmd != nil && c.cmd.Process != nil {
		syscall.Kill(-c.cmd.Process.Pid, syscall.SIGKILL)
		c.cmd.Process.Kill()
	}
}

func (c boxControl) release() error {
	if c.cg == nil {
		return nil
	}
	return c.cg.Destroy()
}

// oomKills counts the box's processes killed at its memory limit; -1 if
// unknown.
func (c boxControl) oomKills() int64 {
	if c.cg == nil {
		return -1
	}
	return c.cg.OOMKills()
}
