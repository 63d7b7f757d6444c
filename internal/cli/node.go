package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"slices"
	"time"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/cluster"
)

// nodeBackends are the backends a kiln node serves: those whose boxes host
// kiln-agent, whose protocol the node relays.
var nodeBackends = []string{"jail", "gvisor", "microvm", "firecracker"}

const nodeUsage = `Usage:
  kiln node --tls DIR [--listen ADDR] [flags]
                 serve boxes of a node-local backend to kiln fronts
                 (kiln mcp or serve --backend cluster --cluster-nodes ...)
  kiln node certs --dir DIR [--valid D]
                 make a CA and a node's and a front's certificates

`

func runNode(args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "certs" {
		return runNodeCerts(args[1:], stdout, stderr)
	}
	fs := flag.NewFlagSet("kiln node", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c common
	c.registerBox(fs)
	listen := fs.String("listen", "127.0.0.1:7070", "address the fronts reach the node at, host:port")
	reg := registerNodeFlags(fs)
	tlsDir := fs.String("tls", "", "directory of the node's certificates (kiln node certs): ca.pem, node.pem, node-key.pem")
	maxPending := fs.Int("max-pending", cluster.DefaultMaxPending, "connections whose front has not yet shown its certificate; past it a new one is closed at once")
	orphanGrace := fs.Duration("orphan-grace", cluster.DefaultOrphanGrace, "how long a session's box whose front went away is kept for another front to adopt (0: destroyed at once)")
	groupUsage(fs)
	usage := fs.Usage
	fs.Usage = func() { fmt.Fprint(stderr, nodeUsage); usage() }
	if err := c.parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("kiln node: unexpected %q (kiln node [flags] or kiln node certs)", fs.Arg(0))
	}
	if *maxPending <= 0 {
		return fmt.Errorf("kiln node: --max-pending must be at least 1, not %d", *maxPending)
	}
	if *orphanGrace < 0 {
		return fmt.Errorf("kiln node: --orphan-grace must not be negative, not %s", *orphanGrace)
	}
	grace := *orphanGrace
	if grace == 0 {
		grace = -1 // NodeOptions: destroyed at once
	}
	if *tlsDir == "" {
		return errors.New("kiln node needs --tls DIR, the node's certificates: make them with kiln node certs --dir DIR")
	}
	if !slices.Contains(nodeBackends, c.backend) {
		return fmt.Errorf("kiln node serves the %s backends, not %q", orList(nodeBackends), c.backend)
	}
	cfg, err := cluster.NodeTLS(*tlsDir)
	if err != nil {
		return err
	}
	log := c.logger(stderr)
	ctx, cancel := signalContext()
	defer cancel()
	tpl, err := c.tpl.load(c.backend)
	if err != nil {
		return err
	}
	preload := templatePreload(tpl, splitList(c.preload))
	maxBoxes, all := c.bounds.resolve(c.limits())
	env := backendEnv{agent: c.agent, net: &network{}, allBoxes: all, log: log}
	if tpl != nil {
		env.template = tpl.FilesDir()
	}
	b, err := c.backends.newBackend(ctx, c.backend, env)
	if err != nil {
		return fmt.Errorf("starting %s backend: %w", c.backend, err)
	}
	defer b.Close()
	if w, ok := b.(sandbox.Warmer); ok {
		go func() {
			if err := w.Warm(ctx, sandbox.Spec{Limits: c.limits().WithDefaults(), Preload: preload}); err != nil {
				log.Warn("preparing the template ahead of demand", "err", err)
			}
		}()
	}
	n, err := cluster.NewNode(cluster.NodeOptions{Backend: b, TLS: cfg, Limits: c.limits(), Preload: preload, MaxBoxes: maxBoxes, MaxPending: *maxPending, OrphanGrace: grace, Logger: log})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	served := make(chan error, 1)
	go func() { served <- n.Serve(ln) }()
	log.Info("kiln node serving boxes to fronts", "addr", ln.Addr().String(), "backend", c.backend, "max_boxes", maxBoxes)
	registered, err := reg.start(ctx, ln.Addr().String(), log)
	if err != nil {
		n.Close()
		return err
	}
	select {
	case err = <-served:
	case <-ctx.Done():
	}
	// The Lease goes first, so that fronts stop placing boxes here.
	if registered != nil {
		if cerr := registered.Close(); cerr != nil {
			log.Warn("leaving the cluster", "err", cerr)
		}
	}
	n.Close()
	return err
}

func runNodeCerts(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln node certs", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "", "directory to write the certificates to (made if missing; it must hold none of them)")
	valid := fs.Duration("valid", 365*24*time.Hour, "how long the certificates are valid")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dir == "" {
		return errors.New("kiln node certs needs --dir DIR")
	}
	if err := cluster.WriteCerts(*dir, *valid); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote a CA and a node's and a front's certificates to %s, valid for %s:\n"+
		"  each node: kiln node --tls DIR with %s, %s, %s\n"+
		"  each front: --backend cluster --cluster-tls DIR with %s, %s, %s\n"+
		"The CA's key is not kept: for more certificates, make a new directory and give up this one.\n",
		*dir, *valid, cluster.CAFile, cluster.NodeCertFile, cluster.NodeKeyFile, cluster.CAFile, cluster.FrontCertFile, cluster.FrontKeyFile)
	return nil
}
