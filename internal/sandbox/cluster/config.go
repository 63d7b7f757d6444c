package cluster

import (
	"flag"
	"strings"
)

// Config is the cluster backend's part of kiln's command line: the flags
// only it reads.
type Config struct {
	Nodes string // --cluster-nodes
	TLS   string // --cluster-tls
}

// RegisterFlags defines the cluster backend's flags on fs, storing their
// values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Nodes, "cluster-nodes", "", "cluster: addresses (host:port) of the kiln nodes to place boxes on, comma-separated")
	fs.StringVar(&c.TLS, "cluster-tls", "", "cluster: directory of the front's certificates (kiln node certs): ca.pem, front.pem, front-key.pem")
}

// Apply fills opts from the flags, reading the certificates.
func (c *Config) Apply(opts Options) (Options, error) {
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
