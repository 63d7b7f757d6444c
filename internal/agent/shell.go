package agent

import (
	"errors"
	"os/exec"
	"syscall"
	"time"

	"kiln/internal/agentproto"
)

// shellWaitDelay is how long a finished command's background children may
// keep its output pipes open before the agent stops reading them.
const shellWaitDelay = 200 * time.Millisecond

func (a *Agent) runShell(command string, maxOutput int) (*agentproto.ExecResult, error) {
	stdout, stderr := newCapBuf(maxOutput), newCapBuf(maxOutput)
	cmd := exec.Command("/bin/bash", "-c", command)
	cmd.Dir = a.cfg.Workspace
	cmd.Env = childEnv(a.cfg)
	cmd.Stdout = stdout
	cmd.Stderr = stderr
	cmd.SysProcAttr = childAttr(a.cfg)
	cmd.WaitDelay = shellWaitDelay
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	a.smu.Lock()
	a.shells[cmd] = struct{}{}
	a.smu.Unlock()
	err := cmd.Wait()
	a.smu.Lock()
	delete(a.shells, cmd)
	a.smu.Unlock()

	res := &agentproto.ExecResult{Stdout: stdout.Stream(), Stderr: stderr.Stream()}
	var ee *exec.ExitError
	switch {
	case err == nil, errors.Is(err, exec.ErrWaitDelay):
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
