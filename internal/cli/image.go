package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"kiln/internal/image"
)

func runImage(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "build" {
		return errors.New("usage: kiln image build [--force] [--agent PATH] [--firecracker-kernel] [--oci REF [--insecure] [--node]]")
	}
	fs := flag.NewFlagSet("kiln image build", flag.ContinueOnError)
	fs.SetOutput(stderr)
	force := fs.Bool("force", false, "rebuild even when an image with the same inputs is cached")
	agent := fs.String("agent", "", "static kiln-agent to install as the guest's init (default: next to kiln)")
	fcKernel := fs.Bool("firecracker-kernel", false, "also build a vmlinux for Firecracker from Debian's linux-source (slow: many minutes)")
	oci := fs.String("oci", "", "build the kubernetes backend's box image instead (the same Debian root and agent, as an OCI image) and push it to this reference, e.g. registry.example:5000/kiln/box:1")
	insecure := fs.Bool("insecure", false, "with --oci: the registry speaks plain HTTP")
	node := fs.Bool("node", false, "with --oci: a kiln node's image instead (contrib/kubernetes/node.yaml): the same root with this kiln beside the agent, started as kiln node")
	verbose := fs.Bool("v", false, "debug logging")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	c := common{verbose: *verbose}
	log := c.logger(stderr)
	ctx, cancel := signalContext()
	defer cancel()
	if *node && *oci == "" {
		return errors.New("kiln image build: --node builds an OCI image: pass --oci REF too")
	}
	if *oci != "" {
		self := ""
		if *node {
			exe, err := os.Executable()
			if err != nil {
				return fmt.Errorf("finding this kiln for the node image: %w", err)
			}
			self = exe
		}
		ref, err := buildOCI(ctx, image.Options{Agent: *agent, Force: *force, Logger: log}, *oci, *insecure, self)
		var missing *missingFeatureError
		if errors.As(err, &missing) {
			return err
		}
		if err != nil {
			return fmt.Errorf("building the box image: %w", err)
		}
		fmt.Fprintln(stdout, ref)
		return nil
	}
	im, err := image.Build(ctx, image.Options{Agent: *agent, Force: *force, Logger: log})
	if err != nil {
		return fmt.Errorf("building the guest image: %w", err)
	}
	fmt.Fprintf(stdout, "image %s\n  kernel %s (%s)\n  rootfs %s\n  python %s with %v\n", im.Dir, im.KernelPath(), im.KernelVersion, im.RootfsPath(), im.Python, im.Libraries)
	if *fcKernel {
		vmlinux, err := image.BuildFirecrackerKernel(ctx, image.KernelOptions{Force: *force, Logger: log})
		if err != nil {
			return fmt.Errorf("building the firecracker kernel: %w", err)
		}
		fmt.Fprintf(stdout, "  firecracker kernel %s\n", vmlinux)
	}
	return nil
}
