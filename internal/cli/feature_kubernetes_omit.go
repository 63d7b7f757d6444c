//go:build !kiln_kubernetes

package cli

import (
	"context"
	"flag"
	"io"
	"log/slog"

	"kiln/internal/session"
)

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

func discoverNodes(string) (func(context.Context) ([]string, error), error) {
	return nil, featureKubernetes.missing()
}

func sessionLedger(context.Context, string, *slog.Logger) (session.Ledger, error) {
	return nil, featureKubernetes.missing()
}

// nodeRegister has no flags here: kiln node's --k8s-register is answered
// by hintMissingFlag.
type nodeRegister struct{}

func registerNodeFlags(*flag.FlagSet) *nodeRegister { return &nodeRegister{} }

func (*nodeRegister) start(context.Context, string, *slog.Logger) (io.Closer, error) {
	return nil, nil
}

const hasKubernetes = false
