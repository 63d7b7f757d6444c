package cli

import (
	"errors"
	"io"

	"kiln/internal/sandbox/kubernetes"
)

// runK8s is `kiln k8s`: what an operator puts on a cluster for the
// kubernetes backend.
func runK8s(args []string, stdout io.Writer) error {
	if len(args) != 1 || args[0] != "seccomp-profile" {
		return errors.New("usage: kiln k8s seccomp-profile   (kiln's syscall policy as a Localhost seccomp profile: put it on every node under the kubelet's seccomp directory and pass its path there as --k8s-seccomp-profile)")
	}
	_, err := stdout.Write(kubernetes.SeccompProfile())
	return err
}
