//go:build kiln_kubernetes

package cli

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"kiln/internal/bench"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/kubernetes"
	"kiln/internal/session"
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

// discoverNodes lists the kiln nodes registered in namespace, for
// --cluster-discover.
func discoverNodes(namespace string) (func(context.Context) ([]string, error), error) {
	l, err := kubernetes.NewNodeLister("", namespace)
	if err != nil {
		return nil, err
	}
	return l.Nodes, nil
}

// sessionLedger is the fronts' shared count of sessions in namespace, for
// --cluster-quotas.
func sessionLedger(ctx context.Context, namespace string, log *slog.Logger) (session.Ledger, error) {
	return kubernetes.NewSessionLedger(ctx, kubernetes.LedgerOptions{Namespace: namespace, Logger: log})
}

// nodeRegister is kiln node's registration in the cluster's API: its
// --k8s-register flags.
type nodeRegister struct {
	namespace, name, advertise string
	duration                   time.Duration
}

func registerNodeFlags(fs *flag.FlagSet) *nodeRegister {
	var r nodeRegister
	fs.StringVar(&r.namespace, "k8s-register", "", "register this node as a Lease in this Kubernetes namespace, renewed while it serves, for fronts with --cluster-discover (the client configuration is the in-cluster one, else $KUBECONFIG)")
	fs.StringVar(&r.name, "k8s-node-name", "", "with --k8s-register: this node's name, unique in the namespace (default: the host name, a DaemonSet Pod's name)")
	fs.StringVar(&r.advertise, "k8s-advertise", "", "with --k8s-register: the address fronts reach this node at, host:port (default: --listen; in a Pod, $(POD_IP):PORT from status.podIP)")
	fs.DurationVar(&r.duration, "k8s-node-lease", kubernetes.DefaultNodeLeaseDuration, "with --k8s-register: how long the node's Lease stands unrenewed; fronts stop placing boxes on a node this long after it stops")
	return &r
}

// start registers the node listening at listen, when --k8s-register says
// so; the closer deletes its Lease.
func (r *nodeRegister) start(ctx context.Context, listen string, log *slog.Logger) (io.Closer, error) {
	if r.namespace == "" {
		if r.name != "" || r.advertise != "" {
			return nil, errors.New("--k8s-node-name and --k8s-advertise go with --k8s-register NAMESPACE")
		}
		return nil, nil
	}
	name := r.name
	if name == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("naming this node for its Lease: %w (pass --k8s-node-name)", err)
		}
		name = h
	}
	addr := cmp.Or(r.advertise, listen)
	return kubernetes.RegisterNode(ctx, kubernetes.RegisterOptions{Namespace: r.namespace, Node: name, Address: addr, Duration: r.duration, Logger: log})
}

const hasKubernetes = true
