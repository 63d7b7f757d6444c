package cluster

import (
	"context"
	"flag"
	"strings"
)

// Config is the cluster backend's part of kiln's command line: the flags
// only it reads.
type Config struct {
	Nodes    string // --cluster-nodes
	TLS      string // --cluster-tls
	Discover string // --cluster-discover
	// Quotas is the Kubernetes namespace where the fronts count each
	// principal's live sessions together (--cluster-quotas); the cluster
	// backend itself does not read it.
	Quotas string
}

// Discoverer returns the lister of the nodes registered in a Kubernetes
// namespace (kubernetes.NodeLister's Nodes). A kiln built without the
// kubernetes backend has none: Discover errors.
type Discoverer func(namespace string) (func(context.Context) ([]string, error), error)

// RegisterFlags defines the cluster backend's flags on fs, storing their
// values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Nodes, "cluster-nodes", "", "cluster: addresses (host:port) of the kiln nodes to place boxes on, comma-separated")
	fs.StringVar(&c.Discover, "cluster-discover", "", "cluster: instead of --cluster-nodes, place boxes on the kiln nodes registered in this Kubernetes namespace (kiln node --k8s-register); the client configuration is the in-cluster one, else $KUBECONFIG")
	fs.StringVar(&c.Quotas, "cluster-quotas", "", "cluster: hold --max-sessions-per-principal across every front that passes the same Kubernetes namespace, through Leases there (each front then needs the API server to start a session); default: each front counts its own")
	fs.StringVar(&c.TLS, "cluster-tls", "", "cluster: directory of the front's certificates (kiln node certs): ca.pem, front.pem, front-key.pem")
}

// Apply fills opts from the flags, reading the certificates; discover
// lists the nodes of --cluster-discover.
func (c *Config) Apply(opts Options, discover Discoverer) (Options, error) {
	if c.Discover != "" {
		list, err := discover(c.Discover)
		if err != nil {
			return opts, err
		}
		opts.Discover = list
	}
	for _, a := range strings.Split(c.Nodes, ",") {
		if a = strings.TrimSpace(a); a != "" {
			opts.Nodes = append(opts.Nodes, a)
		}
	}
	if c.TLS == "" {
		return opts, nil // New says what is missing
	}
	cfg, err := FrontTLS(c.TLS)
	if err != nil {
		return opts, err
	}
	opts.TLS = cfg
	return opts, nil
}
