package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"

	"kiln/internal/bench"
	"kiln/internal/image"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/cluster"
	"kiln/internal/sandbox/gvisor"
	"kiln/internal/sandbox/jail"
	"kiln/internal/sandbox/microvm"
	"kiln/internal/sandbox/wasm"
	"kiln/internal/session"
)

// registry lists the backends kiln can serve with, in the order kiln doctor
// checks them; doctor, bench and the serving commands iterate it.
//
// Adding a backend is a driver package and one entry here. The package
// writes: a Backend type with Name, Create and Close (sandbox.Backend) and
// the optional interfaces it can honour, each asserted at compile time
// (sandbox.Checker is expected: Check starts a box and runs sandbox.Probe in
// it; sandbox.Warmer if it builds templates; sandbox.Describer,
// sandbox.Noter; its boxes sandbox.OOMReporter, sandbox.RefusalReporter);
// Options and New; a Config in config.go whose RegisterFlags defines the
// flags only it reads (help text "<name>: …") and that turns them into
// Options; a _linux.go/_other.go split so other platforms build; and, if it
// re-executes kiln as a helper process, a MaybeInit. The entry names it,
// registers its Config's flags and builds it from them and backendEnv
// (refusing an egress policy it cannot enforce), and sets maybeInit,
// setupTemplate or servesTemplatesOf, bench and benchFlags where they
// apply: templates, kiln bench and -h ask the entry, never the name. A
// backend that most hosts do not need and that links much (Kubernetes)
// is an optional feature: its entry sits in feature_<name>.go behind a
// build tag, with an omit file that keeps its name and says how to get it
// (features.go).
var registry = []backendEntry{
	{
		name:          "jail",
		maybeInit:     jail.MaybeInit,
		setupTemplate: setupJail,
		// Under cgroup v2 a box leaves the bench's group for the server's
		// own (jail's serverGroup); under v1 it stays in its cpuacct.
		bench: bench.Traits{BoxCgroups: true, Hardening: true, CPUGroups: []string{jail.ServerCgroupPattern()},
			CPUGroupsNote: "the jail's: kiln/<server pid> under cgroup v2 (kiln/pidns<inode>.<pid> in a container's pid namespace)"},
		flags: func(fs *flag.FlagSet) backendFactory {
			var c jail.Config
			c.RegisterFlags(fs)
			return func(ctx context.Context, env backendEnv) (sandbox.Backend, error) {
				return jail.New(c.Apply(jail.Options{Agent: env.agent, Logger: env.log, Egress: env.net.gateway, Policy: env.net.policy, AllBoxes: env.allBoxes, Template: env.template}))
			}
		},
		benchFlags: func(fs *flag.FlagSet) func() ([]string, error) {
			zygote := fs.String("zygote", "", "jail: 1 to fork boxes from a zygote, 0 not to (default: the server's own default)")
			return func() ([]string, error) {
				if *zygote == "" {
					return nil, nil
				}
				on, err := strconv.ParseBool(*zygote)
				if err != nil {
					return nil, fmt.Errorf("--zygote: %q is not 1 or 0", *zygote)
				}
				return []string{"--zygote=" + strconv.FormatBool(on)}, nil
			}
		},
	},
	{
		name:          "gvisor",
		setupTemplate: setupGvisor,
		// runsc puts each box's sandbox, gofer and their children in a
		// cgroup under gvisor's cgroupParent, of every kiln server on
		// the machine alike.
		bench: bench.Traits{CPUGroups: []string{strings.TrimPrefix(gvisor.CgroupParent, "/")},
			CPUGroupsNote: "gVisor's: " + gvisor.CgroupParent + ", runsc's sandbox and gofer processes (every kiln server's on the machine)",
			Native: func(python string) ([]string, error) {
				runsc, err := cachedRunsc()
				if err != nil {
					return nil, err
				}
				// The platform and network of kiln's boxes by default;
				// --ignore-cgroups keeps runsc do in the bench's cgroup,
				// where its CPU is counted (it makes one of its own else).
				return []string{runsc, "--ignore-cgroups", "--platform=" + gvisor.DefaultPlatform, "--network=none", "do", python, "-c", "print(2+2)"}, nil
			}},
		flags: func(fs *flag.FlagSet) backendFactory {
			var c gvisor.Config
			c.RegisterFlags(fs)
			return func(ctx context.Context, env backendEnv) (sandbox.Backend, error) {
				agent := env.agent
				if agent == "" {
					p, err := jail.FindAgent()
					if err != nil {
						return nil, fmt.Errorf("finding kiln-agent: %w", err)
					}
					agent = p
				}
				runsc := c.Runsc
				switch {
				case runsc != "":
				case env.doctor:
					// Doctor does not build runsc (a minute or more); it checks the cached one.
					p, err := cachedRunsc()
					if err != nil {
						return nil, err
					}
					runsc = p
				default:
					p, err := gvisor.EnsureRunsc(ctx, env.log)
					if err != nil {
						return nil, err
					}
					runsc = p
				}
				return gvisor.New(gvisor.Options{Agent: agent, Runsc: runsc, Logger: env.log, Template: env.template, Egress: env.net.gateway, Policy: env.net.policy})
			}
		},
	},
	{
		name:      "microvm",
		maybeInit: microvm.MaybeInit,
		// The microVM packs a template's files (plain files) into a
		// read-only disk, so it serves templates made on the jail; their
		// --import modules are imported in the guest before the VM is
		// saved.
		servesTemplatesOf: []string{"jail"},
		bench:             bench.Traits{Accel: microvmAccel},
		flags: func(fs *flag.FlagSet) backendFactory {
			var c microvm.Config
			c.RegisterFlags(fs)
			return func(ctx context.Context, env backendEnv) (sandbox.Backend, error) {
				im, err := image.Latest("")
				if err != nil {
					return nil, fmt.Errorf("%w (build one with: kiln image build)", err)
				}
				// With --allow-net every VM gets a tap wired to the gateway.
				return microvm.New(c.Apply(microvm.Options{Image: im, Logger: env.log, Template: env.template, Egress: env.net.gateway, Policy: env.net.policy})) // it logs the TCG warning
			}
		},
	},
	{
		name: "firecracker",
		flags: func(fs *flag.FlagSet) backendFactory {
			var c microvm.FirecrackerConfig
			c.RegisterFlags(fs)
			return func(ctx context.Context, env backendEnv) (sandbox.Backend, error) {
				o := c.Apply(microvm.FirecrackerOptions{Logger: env.log, Egress: env.net.gateway, Policy: env.net.policy})
				// What the host lacks first, then what kiln has not built.
				if _, err := microvm.CheckFirecrackerHost(o.Firecracker); err != nil {
					return nil, err
				}
				if o.Kernel == "" {
					k, err := image.LatestFirecrackerKernel("")
					if err != nil {
						return nil, err
					}
					o.Kernel = k
				}
				im, err := image.Latest("")
				if err != nil {
					return nil, fmt.Errorf("%w (build one with: kiln image build --firecracker-kernel)", err)
				}
				o.Image = im
				return microvm.NewFirecracker(o) // Check: the kernel, the image, firecracker --version, /dev/kvm, a VM
			}
		},
	},
	{
		name:      "wasm",
		maybeInit: wasm.MaybeInit,
		flags: func(fs *flag.FlagSet) backendFactory {
			var c wasm.Config
			c.RegisterFlags(fs)
			return func(ctx context.Context, env backendEnv) (sandbox.Backend, error) {
				if !env.net.policy.Empty() {
					return nil, errors.New("--allow-net is not supported on the wasm backend (its boxes have no network at all)")
				}
				return wasm.New(c.Apply(wasm.Options{Logger: env.log}))
			}
		},
	},
	{
		// A front of kiln nodes (kiln node): the nodes make the boxes,
		// with their own backend, limits and preloads.
		name:       "cluster",
		flagPrefix: "cluster-",
		// kiln bench starts two kiln nodes (the jail) and fronts them.
		bench: bench.Traits{Nodes: 2},
		flags: func(fs *flag.FlagSet) backendFactory {
			var c cluster.Config
			c.RegisterFlags(fs)
			return func(ctx context.Context, env backendEnv) (sandbox.Backend, error) {
				if !env.net.policy.Empty() {
					return nil, errors.New("--allow-net is not supported on the cluster backend yet: a kiln node's boxes have no network")
				}
				o, err := c.Apply(cluster.Options{Logger: env.log}, discoverNodes)
				if err != nil {
					return nil, err
				}
				if c.Quotas != "" && env.ledger != nil {
					if *env.ledger, err = sessionLedger(ctx, c.Quotas, env.log); err != nil {
						return nil, fmt.Errorf("--cluster-quotas: %w", err)
					}
				}
				b, err := cluster.New(o)
				if err != nil && env.ledger != nil && *env.ledger != nil {
					(*env.ledger).(io.Closer).Close()
					*env.ledger = nil
				}
				return b, err
			}
		},
	},
	kubernetesBackend, // feature_kubernetes.go
}

// backendEntry is one backend kiln can serve with.
type backendEntry struct {
	name string
	// absent, if set, says that the backend is not in this build and how
	// to get a kiln that has it (features.go): it is the answer of
	// --backend NAME, of kiln doctor, of the backend's table in a
	// configuration file and, by flagPrefix, of its flags. Such an entry
	// has no flags.
	absent error
	// flagPrefix starts the names of every flag of the backend's own.
	flagPrefix string
	// maybeInit, if set, runs the backend's helper process (a box's init,
	// a jailed VMM) and never returns when kiln was re-executed as one;
	// it returns at once otherwise.
	maybeInit func()
	// flags defines the backend's own flags on fs (every serving command
	// and doctor shows them) and returns what builds the backend from
	// their values once fs is parsed.
	flags func(fs *flag.FlagSet) backendFactory
	// setupTemplate, if set, makes the backend one that makes configured
	// templates (and serves its own): it builds the backend a template's
	// setup runs in, whose boxes have files writable at /template and the
	// template's network policy.
	setupTemplate func(ctx context.Context, o templateSetup, net *network, files string) (sandbox.Backend, error)
	// servesTemplatesOf names the backends whose templates the backend
	// serves though it cannot make them.
	servesTemplatesOf []string
	// egressListens says that the backend's boxes reach the egress
	// gateway over a network, at --egress-listen (kubernetes), rather
	// than each through a link the gateway makes.
	egressListens bool
	// bench is what kiln bench knows of the backend.
	bench bench.Traits
	// benchFlags, if set, defines kiln bench flags that only this backend
	// reads; the function it returns gives the `kiln mcp` arguments they
	// stand for, once fs is parsed.
	benchFlags func(fs *flag.FlagSet) func() ([]string, error)
}

// MaybeInit runs a backend's helper process and never returns when kiln was
// re-executed as one (a jail box's init, a jailed QEMU's init); otherwise it
// returns at once. A binary that serves kiln calls it first thing.
func MaybeInit() {
	for _, e := range registry {
		if e.maybeInit != nil {
			e.maybeInit()
		}
	}
}

// wiresOwnEgress reports whether the named backend is in this build and
// wires each of its boxes to the egress gateway itself, so that
// --egress-listen means nothing to it (backendEntry.egressListens).
func wiresOwnEgress(name string) bool {
	i := slices.IndexFunc(registry, func(e backendEntry) bool { return e.name == name })
	return i >= 0 && registry[i].absent == nil && !registry[i].egressListens
}

// backendFactory builds a backend from its parsed flags and what every
// backend is given.
type backendFactory func(ctx context.Context, env backendEnv) (sandbox.Backend, error)

// backendEnv is what a server gives every backend it builds.
type backendEnv struct {
	agent    string         // --agent; "": next to kiln, then $PATH
	net      *network       // never nil
	allBoxes sandbox.Limits // all boxes together; zero fields: no such limit
	log      *slog.Logger
	template string // a configured template's files (the jail and gvisor take one)
	// doctor builds the backend only to check it: nothing slow is built
	// (runsc), only what is cached is used.
	doctor bool
	// ledger, if not nil, receives the sessions' Ledger a backend's flags
	// ask for (--cluster-quotas); the stack closes it.
	ledger *session.Ledger
}

// backends are the factories of every registered backend, keyed by name,
// made by registerBackends.
type backends map[string]backendFactory

// registerBackends defines every registered backend's flags on fs.
func registerBackends(fs *flag.FlagSet) backends {
	bs := backends{}
	for _, e := range registry {
		if e.absent != nil {
			err := e.absent
			bs[e.name] = func(context.Context, backendEnv) (sandbox.Backend, error) { return nil, err }
			continue
		}
		bs[e.name] = e.flags(fs)
	}
	return bs
}

// newBackend builds the named backend.
func (bs backends) newBackend(ctx context.Context, name string, env backendEnv) (sandbox.Backend, error) {
	f, ok := bs[name]
	if !ok {
		return nil, fmt.Errorf("unknown backend %q (%s)", name, backendNames())
	}
	if env.net == nil {
		env.net = &network{}
	}
	if env.log == nil {
		env.log = discard()
	}
	return f(ctx, env)
}

// backendNames lists the registered backends for people: "a, b or c".
func backendNames() string {
	names := make([]string, len(registry))
	for i, e := range registry {
		names[i] = e.name
	}
	return orList(names)
}

// orList is "a, b or c".
func orList(names []string) string {
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// checkBackend builds the named backend and checks that a box of it runs
// code (sandbox.Checker). Notes the backend has about this host go to
// notes.
func (bs backends) checkBackend(ctx context.Context, name string, env backendEnv, notes func(string)) error {
	env.doctor = true
	b, err := bs.newBackend(ctx, name, env)
	if err != nil {
		return err
	}
	defer b.Close()
	chk, ok := b.(sandbox.Checker)
	if !ok {
		return errors.New("it cannot be checked (it implements no sandbox.Checker)")
	}
	err = chk.Check(ctx)
	// The notes say what the backend shares or lacks here, which matters
	// most when the check says it is weaker than it should be, and how the
	// check's box was made (after it, so they can say).
	if n, ok := b.(sandbox.Noter); ok {
		for _, note := range n.Notes() {
			notes(note)
		}
	}
	return err
}

// microvmAccel is the accelerator a microVM server runs with: its --accel
// flag, else the backend's default.
func microvmAccel(args []string) string {
	accel := microvm.AccelKVM
	for i, a := range args {
		switch {
		case (a == "--accel" || a == "-accel") && i+1 < len(args):
			accel = args[i+1]
		case strings.HasPrefix(a, "--accel="), strings.HasPrefix(a, "-accel="):
			accel = a[strings.Index(a, "=")+1:]
		}
	}
	return accel
}

func cachedRunsc() (string, error) {
	p, err := gvisor.CachedRunscPath()
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("runsc is not built yet (make runsc, or start kiln with --backend gvisor once): %w", err)
	}
	return p, nil
}
