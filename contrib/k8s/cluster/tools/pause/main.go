// Command pause is the Pod sandbox's first process for the test cluster
// (containerd's sandbox_image), built here because the cluster reaches no
// public image registry. It does what Kubernetes' pause does: sleep,
// reap the children that the shared PID namespace hands it, and exit on
// SIGINT or SIGTERM.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
