package gvisor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"kiln/internal/boxpolicy"
	"kiln/internal/egress"
	"kiln/internal/sandbox"
)

// A gVisor box with a policy reaches the network only through the egress
// gateway. Each box (the warm-start template's too) gets a network
// namespace of its own from the gateway (AttachNetNS: eth0 with a /32 and
// on-link routes to the gateway); runsc --network=sandbox copies that
// interface into the box's netstack and writes its frames to the veth
// itself, so the box-side nftables table never sees them: the gateway's
// own firewall (DNAT of a box's TCP to the transparent listener, reject of
// the rest) holds the box, and the gateway knows it by its address.
//
// runsc restore (warm start) does the same with the restored box's new
// namespace: the checkpointed netstack's interfaces are dropped and made
// again from the namespace runsc scrapes as it restores (gVisor's
// Kernel.LoadFrom: ResetConfig, then ConfigureNetwork from the new
// sandbox's links), so a restored box has the address of its own fresh
// attachment, never the template's (TestEgressRestore measures it).
// restore checks that runsc took the new namespace over before the box is
// handed out. State-level snapshots, forks and hibernation make a new box
// with Create, and so a new attachment, like any other.

// network is runsc's --network for every box of the backend.
func (b *Backend) network() string {
	if b.egressOn() {
		return "sandbox"
	}
	return "none"
}

func (b *Backend) egressOn() bool { return b.opts.Egress != nil && !b.opts.Policy.Empty() }

// attachEgress wires box bx to the egress gateway as session's box when the
// backend has a policy, writes the files it needs into its directory and
// pushes the detach onto its cleanup. nil without a policy.
func (b *Backend) attachEgress(ctx context.Context, bx *box, session string) (*boxNet, error) {
	if !b.egressOn() {
		return nil, nil
	}
	att, path, err := b.opts.Egress.AttachNetNS(ctx, egress.BoxInfo{Session: session, Policy: b.opts.Policy})
	if err != nil {
		return nil, fmt.Errorf("attaching egress gateway: %w", err)
	}
	bx.cleanup.Add(att.Close)
	bx.egress, bx.netns = att, path
	dir := filepath.Join(bx.dir, "egress")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating box egress directory: %w", err)
	}
	n := &boxNet{NetNS: path, ResolvConf: filepath.Join(dir, "resolv.conf"), Env: att.Env()}
	if err := os.WriteFile(n.ResolvConf, []byte(att.ResolvConf()), 0o644); err != nil {
		return nil, fmt.Errorf("writing box resolv.conf: %w", err)
	}
	if trust := att.TrustBundle(); len(trust) > 0 {
		n.Trust = filepath.Join(dir, "ca.pem")
		if err := os.WriteFile(n.Trust, trust, 0o644); err != nil {
			return nil, fmt.Errorf("writing box trust bundle: %w", err)
		}
		n.Env = append(n.Env, egress.TrustEnv(boxpolicy.TrustBundle)...)
	}
	return n, nil
}

// prepareEgressRoot makes sure the boxes' root has the files the
// gateway's resolv.conf and (with secrets) CA bundle are bound onto: in the
// host runtime view, kiln's own, it makes them; an image root must have
// them, since kiln does not write into an operator's image, and a box must
// not run pointed at no resolver or without the CA its secrets' hosts are
// signed by.
func (b *Backend) prepareEgressRoot() error {
	if !b.egressOn() {
		return nil
	}
	files := []string{"/etc/resolv.conf"}
	if b.opts.Egress.BoxSetup(b.opts.Policy).TrustBundle != nil {
		files = append(files, boxpolicy.TrustBundle)
	}
	for _, f := range files {
		p := filepath.Join(b.root, f)
		if b.opts.Rootfs == "" {
			if _, err := os.Stat(p); err == nil {
				continue
			}
			if err := os.WriteFile(p, nil, 0o644); err != nil {
				return fmt.Errorf("building box root: %w", err)
			}
			continue
		}
		if st, err := os.Stat(p); err != nil || !st.Mode().IsRegular() {
			return fmt.Errorf("gvisor backend: the image root %s has no file %s to bind the egress gateway's copy onto; create it (empty) in the image", b.root, f)
		}
	}
	return nil
}

// errNetNotTaken is a box whose runsc did not take its network namespace's
// interface over: its netstack's network is not the one the gateway made
// for it.
var errNetNotTaken = errors.New("runsc did not take over the box's network namespace (eth0 still has its address)")

// checkNetTaken reports whether runsc moved the box's interface into its
// netstack: runsc strips the addresses of every interface it takes, so an
// eth0 that still holds the attachment's address was never read, and the
// box's netstack would run with a network the gateway does not know (a
// restored one with the template's). nil without network.
func (bx *box) checkNetTaken() error {
	if bx.netns == "" {
		return nil
	}
	ns, err := netns.GetFromPath(bx.netns)
	if err != nil {
		return fmt.Errorf("checking box network: %w", err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("checking box network: %w", err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("checking box network: %w", err)
	}
	addrs, err := h.AddrList(eth, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("checking box network: %w", err)
	}
	if len(addrs) > 0 {
		return errNetNotTaken
	}
	return nil
}

// NetworkRefusals says which connections the egress policy refused since
// the last call, in words for the model.
func (g *gvBox) NetworkRefusals() []string { return g.bx.egress.NetworkRefusals() }

// CutNetwork makes the egress gateway refuse everything the box asks from
// now on and closes its open connections; the box's netstack has no other
// way out than its veth to the gateway.
func (g *gvBox) CutNetwork() error { return g.bx.egress.CutNetwork() }

// RestrictNetwork narrows what the gateway lets the box reach; the gateway
// alone decides what a gVisor box reaches, so nothing else is needed.
func (g *gvBox) RestrictNetwork(hosts []string) error { return g.bx.egress.RestrictNetwork(hosts) }

var (
	_ sandbox.RefusalReporter = (*gvBox)(nil)
	_ sandbox.NetworkCutter   = (*gvBox)(nil)
)
