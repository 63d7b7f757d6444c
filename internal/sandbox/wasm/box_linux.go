package wasm

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/boxkit"
)

// Deno is confined as boxkit confines a runtime kiln runs on the host (as
// the microvm backend confines QEMU): kiln re-executes itself as the
// confinement init, which gives Deno its own user, mount, pid, net, ipc
// and uts namespaces, a host uid no real user has (one per process), a
// root holding only the host's libraries, Deno's binary and, read-only,
// the Pyodide files, the host scripts, the snapshot and the wheels (and,
// for the process that makes the snapshot, one writable directory), no
// capabilities, no_new_privs, and the seccomp filter
// boxpolicy.DenoSyscallPolicy. Its network namespace is empty: no network
// at all. Deno's own permissions still apply inside.
//
// As a non-root user, the user namespace maps only the user's own uid:
// Deno runs as that uid, everything else is the same.

// MaybeInit runs the confinement init of a Deno process and never returns
// when the process was started as one; otherwise it returns at once.
// cmd/kiln (and test binaries that start wasm boxes) call it first thing.
func MaybeInit() { boxkit.MaybeConfineInit() }

// Host uids of confined Deno processes: one per process, from a range no
// real user or /etc/subuid entry has, just above the jailed QEMU
// processes' (microvm).
const (
	denoUIDBase  = 1<<30 + 1<<28 + 1<<16
	denoUIDSlots = 1 << 16
)

// Where a confined Deno sees what it reads (paths).
var confinedPaths = paths{
	deno:    "/deno",
	pyodide: "/pyodide",
	host:    "/host",
}

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
	self    string // kiln's executable, re-executed as Deno's confinement init
	uidSlot atomic.Uint32

	// seccompNotify, set by the test that derives DenoSyscallPolicy,
	// returns a descriptor for each Deno process's init to wait on
	// (boxkit.Confined.SeccompNotify).
	seccompNotify func() *os.File
}

func (p *platform) init(b *Backend) error {
	p.b = b
	p.owner = boxkit.Self().String()
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("finding own executable: %w", err)
	}
	p.self = self
	var slot [4]byte
	rand.Read(slot[:])
	p.uidSlot.Store(binary.BigEndian.Uint32(slot[:]))
	if os.Geteuid() == 0 {
		if err := openUp(b); err != nil {
			return err
		}
	}
	if os.Geteuid() != 0 {
		// As the microvm backend does: a parent left by a root kiln
		// exists, but its children are root's to make.
		p.why = "no cgroup for wasm boxes (not root): only V8's heap cap and Pyodide's memory cap bound them"
		return nil
	}
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

// openUp makes sure a Deno process's uid, which is no one's, can read the
// runtime: the directories of an install made before Deno was confined
// are 0700 (they hold public files), and are opened up; a directory given
// on the command line is the operator's to fix.
func openUp(b *Backend) error {
	cache, err := CacheDir("")
	if err != nil {
		return err
	}
	// Each is bound by itself: the modes of its parents do not matter.
	for _, d := range []string{b.rt.Deno, b.rt.Pyodide, b.wheels} {
		if d == "" {
			continue
		}
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		if fi.Mode().Perm()&0o005 == 0o005 {
			continue
		}
		if !strings.HasPrefix(d, cache+string(filepath.Separator)) {
			return fmt.Errorf("%s: mode %v: the confined Deno's uid cannot read it (make it readable by all)", d, fi.Mode().Perm())
		}
		if err := os.Chmod(d, fi.Mode().Perm()|0o005); err != nil {
			return fmt.Errorf("opening up %s for the confined Deno: %w", d, err)
		}
	}
	return nil
}

// command returns the command that runs deno confined with the arguments
// args makes for the paths it sees, and the descriptors to close once it
// has started. host are those paths on the host.
func (p *platform) command(host paths, args func(paths) []string) (*exec.Cmd, []*os.File, error) {
	in := confinedPaths
	binds := []boxkit.Bind{
		{Src: host.deno, Dst: in.deno},
		{Src: host.pyodide, Dst: in.pyodide, Dir: true},
		{Src: host.host, Dst: in.host, Dir: true},
	}
	if host.snapshot != "" {
		in.snapshot = "/snapshot.bin"
		binds = append(binds, boxkit.Bind{Src: host.snapshot, Dst: in.snapshot})
	}
	if host.wheels != "" {
		in.wheels = "/wheels"
		binds = append(binds, boxkit.Bind{Src: host.wheels, Dst: in.wheels, Dir: true})
	}
	uid := denoUIDBase + int(p.uidSlot.Add(1)%denoUIDSlots)
	if host.out != "" {
		in.out = "/out"
		if os.Geteuid() == 0 {
			if err := os.Chown(host.out, uid, uid); err != nil {
				return nil, nil, err
			}
		}
		binds = append(binds, boxkit.Bind{Src: host.out, Dst: in.out, Dir: true, RW: true})
	}
	c := boxkit.Confined{
		UID:     uid,
		Exe:     in.deno,
		Args:    args(in),
		Env:     p.b.env(in.host),
		Dir:     in.host,
		Binds:   binds,
		Seccomp: boxpolicy.DenoSyscallPolicy,
		Proc:    true, // Deno finds itself through /proc/self/exe
	}
	var opened []*os.File
	if p.seccompNotify != nil {
		c.SeccompNotify = p.seccompNotify()
		opened = append(opened, c.SeccompNotify)
	}
	self, err := os.Open(p.self)
	if err != nil {
		closeAll(opened)
		return nil, nil, fmt.Errorf("opening own executable: %w", err)
	}
	opened = append(opened, self)
	cmd, more, err := c.Command(self)
	if err != nil {
		closeAll(opened)
		return nil, nil, err
	}
	return cmd, append(opened, more...), nil
}

// run runs cmd (a Deno process that runs no model code: the one that
// makes the snapshot) to its end, killing it if ctx ends first.
func (p *platform) run(ctx context.Context, cmd *exec.Cmd) error {
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		case <-done:
		}
	}()
	err := cmd.Wait()
	close(done)
	return err
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
