package microvm

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"kiln/internal/boxpolicy"
	"kiln/internal/egress"
	"kiln/internal/guestinit"
	"kiln/internal/sandbox"
)

// A VM's network (both drivers): the guest is booted with the network its
// backend's policy gives every box (guestNet, in its box plan), so one
// template serves every box; a box's own attachment to the gateway is
// made when its clone is restored (never in a template, which has a loose
// tap leading nowhere), and its address and trust bundle go to the guest
// with the seed, before the box is handed out. A box that is closed takes
// its attachment with it; a box restored from a snapshot or forked is a
// new Create with an attachment of its own. So no guest ever has an
// address the gateway does not know as that box's.

// newGuestNet is the network of a backend's VMs under policy p on gw; nil
// without one.
func newGuestNet(gw *egress.Gateway, p egress.Policy) *guestNet {
	if gw == nil || p.Empty() {
		return nil
	}
	plan, env := gw.VMNetwork(p, boxpolicy.TrustBundle)
	return &guestNet{plan: plan, env: env}
}

// checkTun checks, for a backend with a network, that taps can be made.
func checkTun(n *guestNet) error {
	if n == nil {
		return nil
	}
	f, err := os.OpenFile("/dev/net/tun", os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("checking taps for --allow-net (load the tun module): %w", err)
	}
	return f.Close()
}

// vmLink is one box's attachment as its guest needs it.
type vmLink struct {
	att   *egress.VMAttachment
	trust []byte // the trust bundle, when the plan says the guest has one
}

// attachVM attaches box id (its VMM is pid; 0 for a namespace of its own)
// with the backend's policy.
func attachVM(ctx context.Context, gw *egress.Gateway, n *guestNet, p egress.Policy, pid int, id string) (*vmLink, error) {
	att, err := gw.AttachVM(ctx, pid, egress.BoxInfo{Session: id, Policy: p})
	if err != nil {
		return nil, fmt.Errorf("attaching egress gateway: %w", err)
	}
	l := &vmLink{att: att}
	if n.plan.TrustBundle {
		l.trust = att.TrustBundle()
		if len(l.trust) == 0 || len(l.trust) > guestinit.MaxTrustBundle {
			att.Close()
			return nil, fmt.Errorf("attaching egress gateway: a trust bundle of %d bytes (the guest takes 1 to %d)", len(l.trust), guestinit.MaxTrustBundle)
		}
	}
	return l, nil
}

// seed is a seed message for the guest: fresh entropy, the time, and the
// box's address and trust bundle if it has a network.
func (l *vmLink) seed() guestinit.Seed {
	var s guestinit.Seed
	rand.Read(s.Entropy[:])
	s.Time = time.Now().UnixNano()
	if l != nil {
		s.Addr = l.att.Addr().As4()
		s.TrustBundle = l.trust
	}
	return s
}

func (l *vmLink) tap() *os.File {
	if l == nil {
		return nil
	}
	return l.att.Tap()
}

func (l *vmLink) close() error {
	if l == nil {
		return nil
	}
	return l.att.Close()
}

// sendSeed writes one seed message (guestinit.SeedPortName) to port and
// waits for its answer; ctx's end closes port.
func sendSeed(ctx context.Context, port io.ReadWriteCloser, s guestinit.Seed) error {
	stop := context.AfterFunc(ctx, func() { port.Close() })
	defer stop()
	if _, err := port.Write(s.Marshal()); err != nil {
		return errors.Join(err, ctx.Err())
	}
	var ans [1]byte
	if _, err := io.ReadFull(port, ans[:]); err != nil {
		return errors.Join(err, ctx.Err())
	}
	if ans[0] != guestinit.SeedOK {
		return errors.New("the guest could not apply its seed (its network: see the guest console)")
	}
	return nil
}

// netBox is a box with a network: what only the gateway knows, on top of
// the agent connection.
type netBox struct {
	*sandbox.AgentConn
	link *vmLink
}

var (
	_ sandbox.RefusalReporter = (*netBox)(nil)
	_ sandbox.NetworkCutter   = (*netBox)(nil)
)

// withLink wraps sb, a box of link's, so that it reports its refusals;
// without a link it is sb.
func withLink(sb *sandbox.AgentConn, link *vmLink) sandbox.Sandbox {
	if link == nil {
		return sb
	}
	return &netBox{AgentConn: sb, link: link}
}

// NetworkRefusals says which connections the egress policy refused since
// the last call, in words for the model.
func (b *netBox) NetworkRefusals() []string { return b.link.att.NetworkRefusals() }

// CutNetwork makes the gateway refuse everything the box asks from now
// on and closes its open connections. The guest's link leads to the
// gateway alone (its bridge, its veth), so nothing else is needed.
func (b *netBox) CutNetwork() error { return b.link.att.CutNetwork() }

// RestrictNetwork narrows what the gateway lets the box reach.
func (b *netBox) RestrictNetwork(hosts []string) error { return b.link.att.RestrictNetwork(hosts) }

// Addr is the box's address on the gateway's network.
func (b *netBox) Addr() string { return b.link.att.Addr().String() }
