//go:build !kiln_kubernetes

package cli

import "io"

// Without the tag kiln_kubernetes the kubernetes backend keeps its place
// in the registry, but everything that asks for it (--backend kubernetes,
// its --k8s-* flags, its table in a configuration file, kiln doctor, kiln
// k8s) is told how to get a kiln that has it.

var kubernetesBackend = backendEntry{
	name:       "kubernetes",
	flagPrefix: "k8s-",
	absent:     featureKubernetes.missing(),
}

func runK8s(args []string, stdout io.Writer) error { return featureKubernetes.missing() }

const hasKubernetes = false
