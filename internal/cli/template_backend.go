package cli

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/gvisor"
	"kiln/internal/sandbox/jail"
)

// templateBackends are the backends that serve configured templates (and
// make them: a template records the backend that ran its setup, and a
// server on another backend refuses it).
var templateBackends = []string{"jail", "gvisor"}

// checkTemplateBackend refuses a backend that cannot serve templates.
func checkTemplateBackend(backend string) error {
	if !slices.Contains(templateBackends, backend) {
		return fmt.Errorf("templates are not supported on the %s backend yet (only on the jail, gvisor and microvm)", backend)
	}
	return nil
}

// setupBackend is the backend a template's setup runs in: its boxes have
// files writable at /template and the template's network policy.
func setupBackend(ctx context.Context, o templateSetup, net *network, files string) (sandbox.Backend, error) {
	switch o.backend {
	case "", "jail":
		b, err := jail.New(jail.Options{Agent: o.agent, Logger: o.log, Egress: net.gateway, Policy: net.policy,
			Template: files, TemplateWritable: true})
		if err != nil {
			return nil, fmt.Errorf("starting the jail: %w", err)
		}
		return b, nil
	case "gvisor":
		if !net.policy.Empty() {
			return nil, errors.New("--allow-net is not supported on the gvisor backend yet: make the template on the jail, or give its setup no network")
		}
		agent := o.agent
		if agent == "" {
			p, err := jail.FindAgent()
			if err != nil {
				return nil, fmt.Errorf("finding kiln-agent: %w", err)
			}
			agent = p
		}
		runsc, err := gvisor.EnsureRunsc(ctx, o.log)
		if err != nil {
			return nil, err
		}
		b, err := gvisor.New(gvisor.Options{Agent: agent, Runsc: runsc, Logger: o.log, Template: files, TemplateWritable: true})
		if err != nil {
			return nil, fmt.Errorf("starting gvisor: %w", err)
		}
		return b, nil
	}
	return nil, checkTemplateBackend(o.backend)
}
