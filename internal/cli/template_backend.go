package cli

import (
	"context"
	"fmt"
	"strings"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/gvisor"
	"kiln/internal/sandbox/jail"
)

// Which backends make and serve configured templates is the registry's
// (backendEntry.setupTemplate and servesTemplatesOf): a template records
// the backend that ran its setup, and a server on another backend refuses
// it unless that backend serves the maker's templates.

// setupJail is the jail's backendEntry.setupTemplate.
func setupJail(ctx context.Context, o templateSetup, net *network, files string) (sandbox.Backend, error) {
	b, err := jail.New(jail.Options{Agent: o.agent, Logger: o.log, Egress: net.gateway, Policy: net.policy,
		Template: files, TemplateWritable: true})
	if err != nil {
		return nil, fmt.Errorf("starting the jail: %w", err)
	}
	return b, nil
}

// setupGvisor is gVisor's backendEntry.setupTemplate.
func setupGvisor(ctx context.Context, o templateSetup, net *network, files string) (sandbox.Backend, error) {
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
	b, err := gvisor.New(gvisor.Options{Agent: agent, Runsc: runsc, Logger: o.log, Template: files, TemplateWritable: true,
		Egress: net.gateway, Policy: net.policy})
	if err != nil {
		return nil, fmt.Errorf("starting gvisor: %w", err)
	}
	return b, nil
}

// entry is the registry's entry of the named backend, nil for none.
func entry(name string) *backendEntry {
	for i := range registry {
		if registry[i].name == name {
			return &registry[i]
		}
	}
	return nil
}

// templateServers lists, for people, the backends that serve templates.
func templateServers() string {
	var names []string
	for _, e := range registry {
		if e.setupTemplate != nil || len(e.servesTemplatesOf) > 0 {
			names = append(names, e.name)
		}
	}
	return orList(names)
}

// checkServeBackend refuses a backend that cannot serve templates.
func checkServeBackend(backend string) error {
	if e := entry(backend); e != nil && (e.setupTemplate != nil || len(e.servesTemplatesOf) > 0) {
		return nil
	}
	return fmt.Errorf("templates are not supported on the %s backend yet (only on the %s)", backend, strings.Replace(templateServers(), " or ", " and ", 1))
}

// checkCreateBackend refuses a backend that cannot make templates, saying
// where to make one for it.
func checkCreateBackend(backend string) error {
	e := entry(backend)
	switch {
	case e != nil && e.setupTemplate != nil:
		return nil
	case e != nil && len(e.servesTemplatesOf) > 0:
		maker := e.servesTemplatesOf[0]
		return fmt.Errorf("templates are made on the %s for the %s backend (kiln template create --backend %s): a %s server serves them", maker, backend, maker, backend)
	}
	return checkServeBackend(backend)
}

// templateMakers lists, for people, the backends that make templates.
func templateMakers() string {
	var names []string
	for _, e := range registry {
		if e.setupTemplate != nil {
			names = append(names, e.name)
		}
	}
	return strings.Join(names, " or ")
}

// setupBackend is the backend a template's setup runs in: its boxes have
// files writable at /template and the template's network policy.
func setupBackend(ctx context.Context, o templateSetup, net *network, files string) (sandbox.Backend, error) {
	name := o.backend
	if name == "" {
		name = "jail"
	}
	if err := checkCreateBackend(name); err != nil {
		return nil, err
	}
	return entry(name).setupTemplate(ctx, o, net, files)
}

// servedBy lists the backends besides backend whose templates it serves.
func servedBy(backend string) []string {
	if e := entry(backend); e != nil {
		return e.servesTemplatesOf
	}
	return nil
}
