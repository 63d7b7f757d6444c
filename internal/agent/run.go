package agent

import (
	"fmt"
	"io"
	"os"

	"kiln/internal/guestinit"
)

// Mode is how kiln-agent was started: the agent's Config and the role
// the box gave it.
type Mode struct {
	Config
	// Guest prepares a microVM guest (mounts, serial port) as PID 1.
	Guest bool
	// Zygote becomes a jail zygote's python template (control socket on
	// fd 3).
	Zygote bool
	// AdoptKernel, if positive, is the pid of the kernel a jail zygote
	// forked for this box, whose pipes are on fds 3-9.
	AdoptKernel int
	// AwaitHost serves hosts that attach to the agent's stdin after the
	// box started, one after another (Kubernetes): the agent says hello
	// when a host's agentproto.AttachMarker arrives, not before (an attach
	// does not replay what was written before it), and again for each
	// later host (Agent.ServeAttached).
	AwaitHost bool
}

// Run is kiln-agent after its flags are parsed: it takes the role m and
// the process's place in the box (PID 1 or the agent PID 1 started) give
// it, and returns the process's exit code. Config.Logger must be set.
func Run(m Mode) int {
	log := m.Logger
	if m.Zygote {
		err := ExecZygote(Config{Workspace: m.Workspace, Python: m.Python, Preload: m.Preload, UID: -1, GID: -1})
		fmt.Fprintln(os.Stderr, "kiln-agent:", err)
		return 1
	}
	// Code the agent runs may never reach it: no core dumps, no ptrace or
	// /proc access by its uid, no descriptor inherited by what it starts.
	// A guest's PID 1 only reaps and starts the serving agent, which needs
	// the bounding set PID 1 keeps.
	if err := Harden((os.Getpid() != 1 || !m.Guest) && m.UID >= 0); err != nil {
		log.Error("hardening the agent", "err", err)
		return 1
	}
	var adopted []*os.File
	if m.AdoptKernel > 0 {
		adopted = AdoptedFiles()
	}

	streamPath := ""
	if m.Guest && os.Getenv(reapChildEnv) == "" {
		p, err := guestinit.Setup()
		if err != nil {
			log.Error("preparing guest", "err", err)
			return 1
		}
		streamPath = p
	}
	if os.Getpid() == 1 && m.Guest {
		// A guest's PID 1 only reaps; a child does the work, and when it
		// ends, even by a fault, PID 1 powers the guest off.
		code := reap(streamPath, adopted)
		guestinit.PowerOff()
		return code
	}
	if os.Getpid() == 1 {
		// Elsewhere the agent is its box's PID 1 (the jail's, a Pod's,
		// runsc's sandbox) and serves and reaps itself: one process
		// fewer per box than a reaper with a serving child.
		if m.AdoptKernel > 0 {
			kids.adopt(m.AdoptKernel)
		}
		reapOrphans()
	}

	var r io.Reader = os.Stdin
	var w io.Writer = os.Stdout
	if p := os.Getenv(reapStreamEnv); p != "" {
		f, err := os.OpenFile(p, os.O_RDWR, 0)
		if err != nil {
			log.Error("opening stream", "path", p, "err", err)
			return 1
		}
		r, w = f, f
	}
	cfg := m.Config
	if m.AdoptKernel > 0 {
		cfg.Adopt = NewAdopted(m.AdoptKernel, adopted)
	}
	if m.Guest {
		cfg.Cgroup = guestinit.CodeCgroup // the guest's memory and pids limits for code
		// PID 1 built the box from this plan (it stops without one):
		// the host checks that the guest says so.
		plan, err := guestinit.PlanDigest()
		if err != nil {
			log.Error("reading the box plan", "err", err)
			return 1
		}
		cfg.Plan = plan
	}
	serve := New(cfg).Serve
	if m.AwaitHost {
		serve = New(cfg).ServeAttached
	}
	if err := serve(r, w); err != nil {
		fmt.Fprintln(os.Stderr, "kiln-agent:", err)
		return 1
	}
	return 0
}
