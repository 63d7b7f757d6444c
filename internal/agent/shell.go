package agent

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"

	"kiln/internal/agentproto"
)

// shellWaitDelay is how long a finished command's background children may
// keep its output pipes open before the agent stops reading them.
const shellWaitDelay = 200 * time.Millisecond

// shellDrainLimit is how long the agent waits for the end of a finished
// command's output when nothing of its process group is left: its pipes
// are closed and only a slow reader (a loaded host) is behind. Only a child
// that left the group (setsid) can hold them that long.
const shellDrainLimit = 10 * time.Second

// shellReadHook, when set (by tests), runs before each chunk of a command's
// output is kept: a slow reader, as on a loaded host.
var shellReadHook func()

func (a *Agent) runShell(command string, maxOutput int, live *liveTail) (*agentproto.ExecResult, error) {
	stdout, stderr := newCapBuf(maxOutput), newCapBuf(maxOutput)
	stdout.tee, stderr.tee = live, live
	cmd := codeCommand(a.cfg, "/bin/bash", "-c", command)
	cmd.Dir = a.cfg.Workspace
	cmd.Env = childEnv(a.cfg)
	cmd.SysProcAttr = childAttr(a.cfg)
	// The agent reads the pipes itself rather than through exec's WaitDelay,
	// which closes them a fixed time after the command exits even when the
	// bytes are already in them.
	outs, err := startOutputs(cmd, stdout, stderr)
	if err != nil {
		return nil, err
	}
	if err := kids.start(cmd); err != nil {
		outs.abandon()
		return nil, err
	}
	outs.started()
	a.smu.Lock()
	a.shells[cmd] = struct{}{}
	a.smu.Unlock()
	err = cmd.Wait()
	kids.done(cmd.Process.Pid)
	a.smu.Lock()
	delete(a.shells, cmd)
	a.smu.Unlock()
	limit := shellWaitDelay
	if !groupAlive(cmd.Process.Pid) {
		limit = shellDrainLimit
	}
	outs.drain(limit)

	res := &agentproto.ExecResult{Stdout: stdout.Stream(), Stderr: stderr.Stream()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
	default:
		return nil, err
	}
	if ps := cmd.ProcessState; ps != nil {
		res.ExitCode = ps.ExitCode()
		if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			res.Signal = unixSignalName(ws.Signal())
			res.ExitCode = 128 + int(ws.Signal())
			res.Interrupt = ws.Signal() == syscall.SIGINT
		}
	}
	return res, nil
}

// groupAlive says whether anything is left of the process group the
// command led (its background children).
func groupAlive(pgid int) bool {
	err := syscall.Kill(-pgid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// outputs are a command's stdout and stderr pipes and the goroutines that
// keep what comes out of them.
type outputs struct {
	readers, writers []*os.File
	done             chan struct{}
	n                int
}

func startOutputs(cmd *exec.Cmd, bufs ...*capBuf) (*outputs, error) {
	o := &outputs{done: make(chan struct{}, len(bufs))}
	for _, b := range bufs {
		r, w, err := os.Pipe()
		if err != nil {
			o.abandon()
			return nil, fmt.Errorf("creating an output pipe: %w", err)
		}
		o.readers, o.writers = append(o.readers, r), append(o.writers, w)
		go o.keep(r, b)
	}
	cmd.Stdout, cmd.Stderr = o.writers[0], o.writers[1]
	o.n = len(bufs)
	return o, nil
}

func (o *outputs) keep(r *os.File, b *capBuf) {
	defer func() { o.done <- struct{}{} }()
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if shellReadHook != nil {
				shellReadHook()
			}
			b.Write(buf[:n])
		}
		if err != nil {
			return
		}
	}
}

// started closes the agent's copies of the write ends: the command holds
// them now.
func (o *outputs) started() {
	for _, w := range o.writers {
		w.Close()
	}
}

// drain waits up to limit for the end of both streams, then closes them.
func (o *outputs) drain(limit time.Duration) {
	timer := time.NewTimer(limit)
	defer timer.Stop()
	for left := o.n; left > 0; left-- {
		select {
		case <-o.done:
		case <-timer.C:
			o.abandon()
			for ; left > 0; left-- {
				<-o.done
			}
			return
		}
	}
	for _, r := range o.readers {
		r.Close()
	}
}

// abandon closes every pipe, which ends the goroutines reading them.
func (o *outputs) abandon() {
	for _, f := range append(o.readers, o.writers...) {
		f.Close()
	}
}

// interruptGroup sends SIGINT to the command's process group, then SIGKILL
// a moment later if it is still there.
func interruptGroup(cmd *exec.Cmd) {
	if cmd.Process == nil {
		return
	}
	pgid := cmd.Process.Pid
	syscall.Kill(-pgid, syscall.SIGINT)
	time.AfterFunc(500*time.Millisecond, func() { syscall.Kill(-pgid, syscall.SIGKILL) })
}
