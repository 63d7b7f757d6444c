package agent

import (
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"syscall"
)

// Environment variables between a microVM guest's PID 1 and the agent it
// starts (reap).
const (
	reapChildEnv  = "KILN_AGENT_CHILD"  // set in the child: do not reap, serve
	reapStreamEnv = "KILN_AGENT_STREAM" // a device to speak the protocol on instead of stdin/stdout
)

// An agent that is its box's PID 1 serves and reaps at once: every
// process of the box whose parent dies re-parents to it, and would stay
// a zombie, holding a slot of the box's process limit, unless it is
// reaped. The agent's own children are collected by their exec.Cmd.Wait
// (and the adopted kernel by its watcher), so the reaper must never take
// their statuses: it peeks at a dead child (waitid with WNOWAIT) and
// reaps it only when it is not one of them. Children are started and
// recorded under mu held for reading, and a reaping pass holds it for
// writing, so no pass sees a child of the agent's before it is recorded.
type children struct {
	mu  sync.RWMutex
	own sync.Map // pid → struct{}: started by the agent, waited for by their starter
	// reaping is set once the agent is PID 1 and reaps (reapOrphans).
	reaping bool
}

var kids children

// start starts cmd as a child of the agent's own.
func (c *children) start(cmd *exec.Cmd) error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if err := cmd.Start(); err != nil {
		return err
	}
	c.own.Store(cmd.Process.Pid, struct{}{})
	return nil
}

// adopt records pid, a child the agent did not start (the box's kernel,
// forked by PID 1 before it became the agent), as its own.
func (c *children) adopt(pid int) { c.own.Store(pid, struct{}{}) }

// done is called once the starter has waited for pid: a pass that
// stopped at that dead child (below) can go on.
func (c *children) done(pid int) {
	c.own.Delete(pid)
	if c.reaping {
		c.pass()
	}
}

// reapOrphans makes the agent, PID 1 of its box, reap the box's orphans
// for as long as it runs.
func reapOrphans() {
	kids.reaping = true
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGCHLD)
	go func() {
		for range sigs {
			kids.pass()
		}
	}()
	kids.pass() // those that died before the signal was caught
}

// pass reaps the dead children that are not the agent's own. The kernel
// offers dead children in one order: a pass stops at one of the agent's
// own, which its starter reaps soon, and done starts the next pass.
func (c *children) pass() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		var info siginfo
		if err := peekDead(&info); err != nil || info.pid == 0 {
			return
		}
		if _, own := c.own.Load(int(info.pid)); own {
			return
		}
		var ws syscall.WaitStatus
		if _, err := syscall.Wait4(int(info.pid), &ws, syscall.WNOHANG, nil); err != nil {
			return
		}
	}
}

// reap runs the agent as a child of PID 1 and reaps every process of the
// box until that child exits, whose exit status it returns: a microVM
// guest's PID 1, which powers the guest off when the agent ends, even by
// a fault of its own. extra are descriptors for the agent child, at fds
// 3 and up; PID 1 closes its copies.
func reap(streamPath string, extra []*os.File) int {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGCHLD, syscall.SIGTERM, syscall.SIGINT)
	self, err := os.Executable()
	if err != nil {
		self = "/proc/self/exe"
	}
	cmd := exec.Command(self, os.Args[1:]...)
	cmd.Env = append(os.Environ(), reapChildEnv+"=1")
	if streamPath != "" {
		cmd.Env = append(cmd.Env, reapStreamEnv+"="+streamPath)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.ExtraFiles = extra
	err = cmd.Start()
	for _, f := range extra {
		f.Close()
	}
	if err != nil {
		os.Stderr.WriteString("kiln-agent: starting agent: " + err.Error() + "\n")
		return 1
	}
	child := cmd.Process.Pid
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			syscall.Kill(child, syscall.SIGKILL)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
			if pid == child {
				if ws.Signaled() {
					return 128 + int(ws.Signal())
				}
				return ws.ExitStatus()
			}
		}
	}
	return 0
}
