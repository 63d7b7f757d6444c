package agent

import (
	"os"
	"os/exec"
	"os/signal"
	"syscall"
)

// Environment variables between the PID 1 reaper and the agent it starts.
const (
	reapChildEnv  = "KILN_AGENT_CHILD"  // set in the child: do not reap, serve
	reapStreamEnv = "KILN_AGENT_STREAM" // a device to speak the protocol on instead of stdin/stdout
)

// reap runs the agent as a child of PID 1 and reaps every process of the
// box until that child exits, whose exit status it returns. Orphans
// re-parent to PID 1, so without this they would stay zombies. extra are
// descriptors for the agent child, at fds 3 and up (an adopted kernel's
// pipes); PID 1 closes its copies.
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
