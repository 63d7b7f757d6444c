//go:build kiln_kubernetes

package cli

import (
	"context"
	"errors"
	"flag"
	"io"

	"kiln/internal/bench"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/kubernetes"
)

// The kubernetes backend, built in by the tag kiln_kubernetes (see
// features.go): it links client-go, which doubles kiln's size.

var kubernetesBackend = backendEntry{
	name:          "kubernetes",
	flagPrefix:    "k8s-",
	egressListens: true,
	bench:         bench.Traits{Cluster: true},
	flags: func(fs *flag.FlagSet) backendFactory {
		var c kubernetes.Config
		c.RegisterFlags(fs)
		return func(ctx context.Context, env backendEnv) (sandbox.Backend, error) {
			return kubernetes.New(ctx, c.Apply(kubernetes.Options{Logger: env.log, Egress: env.net.gateway, Policy: env.net.policy}))
		}
	},
}

// runK8s is `kiln k8s`: what an operator puts on a cluster for the
// kubernetes backend.
func runK8s(args []string, stdout io.Writer) error {
	if len(args) != 1 || args[0] != "seccomp-profile" {
		return errors.New("usage: kiln k8s seccomp-profile   (kiln's syscall policy as a Localhost seccomp profile: put it on every node under the kubelet's seccomp directory and pass its path there as --k8s-seccomp-profile)")
	}
	_, err := stdout.Write(kubernetes.SeccompProfile())
	return err
}

const hasKubernetes = true
