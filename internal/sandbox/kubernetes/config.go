package kubernetes

import (
	"flag"
	"time"
)

// Config is the Kubernetes backend's part of kiln's command line: the
// flags only this backend reads.
type Config struct {
	Image           string
	Namespace       string
	Kubeconfig      string
	LeaseDuration   time.Duration
	RuntimeClass    string
	SeccompProfile  string
	Replica         string
	TTL             time.Duration
	NoNetworkPolicy bool
	WarmPool        int
	UIDs            UIDRange
}

// RegisterFlags defines the Kubernetes backend's flags on fs, storing their
// values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Image, "k8s-image", "", "kubernetes: the box image, as pushed by kiln image build --oci (required)")
	fs.StringVar(&c.Namespace, "k8s-namespace", "", "kubernetes: namespace of the boxes (default: kiln's own in a cluster, else default)")
	fs.DurationVar(&c.LeaseDuration, "k8s-lease-duration", 0, "kubernetes: how long this replica's Lease stands unrenewed; a replica silent for twice as long is taken for dead and its boxes are collected (default 30s)")
	fs.StringVar(&c.Kubeconfig, "k8s-kubeconfig", "", "kubernetes: kubeconfig file (default: in-cluster, else $KUBECONFIG or ~/.kube/config)")
	fs.StringVar(&c.RuntimeClass, "k8s-runtime-class", "", "kubernetes: RuntimeClass of the boxes, e.g. gvisor (default: the cluster's default runtime)")
	fs.StringVar(&c.SeccompProfile, "k8s-seccomp-profile", "", "kubernetes: path of kiln's seccomp profile under the kubelet's seccomp directory on every node (kiln k8s seccomp-profile prints it; default: the runtime's default profile)")
	fs.StringVar(&c.Replica, "k8s-replica", "", "kubernetes: this replica's name, unique in the namespace (default: host name and a random suffix)")
	fs.DurationVar(&c.TTL, "k8s-box-ttl", 0, "kubernetes: delete a box this long after it started, whatever its session (0: never)")
	fs.IntVar(&c.WarmPool, "k8s-warm-pool", DefaultWarmPool, "kubernetes: box Pods each replica keeps running ahead of demand, taken by any replica (0: none)")
	c.UIDs = DefaultUIDRange
	fs.Var(&c.UIDs, "k8s-uid-range", "kubernetes: host uids (and gids) to run each box's code as, one of its own per box, as FIRST-LAST; no host user or other program may use them")
	fs.BoolVar(&c.NoNetworkPolicy, "k8s-no-network-policy", false, "kubernetes: do not apply the boxes' default-deny NetworkPolicy (the operator applies it)")
}

// Apply sets the options the flags name.
func (c *Config) Apply(o Options) Options {
	o.Image = c.Image
	o.Namespace = c.Namespace
	o.Kubeconfig = c.Kubeconfig
	o.LeaseDuration = c.LeaseDuration
	o.RuntimeClass = c.RuntimeClass
	o.SeccompProfile = c.SeccompProfile
	o.Replica = c.Replica
	o.TTL = c.TTL
	o.NoNetworkPolicy = c.NoNetworkPolicy
	o.WarmPool = c.WarmPool
	o.UIDs = c.UIDs
	return o
}
