//go:build linux

package egress

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
	"kiln/internal/netnsrun"
)

// A VM is attached as a box is (attachNS), in a network namespace of its
// own that holds nothing but the box's end of the veth, eth0, and the VM's
// tap, joined by a bridge:
//
//	guest eth0 ─ virtio-net ─ tap0 ─┐
//	                                br0 ─ eth0 ═ veth ═ kbN (gateway namespace)
//
// The guest itself carries the box's /32 (it gets it with its seed, see
// boxpolicy.Network), so its frames reach kbN as a jailed box's would and
// the gateway's own rules hold it: TCP from kb* to any address is
// redirected to the transparent listeners, everything else but DNS and the
// proxy is refused, and strict reverse-path filtering keeps it to its own
// address. The namespace's eth0 loses the address attachNS gave it, so
// that only the guest answers for it; the box firewall attachNS installs
// there sees nothing (bridged frames are not the namespace's output), and
// nothing in it needs to. Frames are bridged, not routed: the namespace
// forwards nothing at layer 3.
//
// A bridge rather than tc mirred: it needs only netlink's link calls, and
// the gateway end learns the guest's MAC by ARP as it would a jailed
// box's.

// TapName is a VM's tap device in its network namespace (AttachVM).
const TapName = "tap0"

// vmBridge joins TapName and the box's end of the veth.
const vmBridge = "br0"

// VMAttachment is a VM's connection to the gateway: an Attachment (the
// guest's address is Addr) and the VM's tap. Close removes both.
type VMAttachment struct {
	*Attachment
	tap *os.File
}

// Tap is the tap's queue for a VMM that takes it as a descriptor
// (QEMU's -netdev tap,fd=N), made with IFF_VNET_HDR; nil for a VM
// attached in its VMM's namespace, whose VMM opens TapName itself. The
// attachment owns it: pass it to the VMM, never close it.
func (a *VMAttachment) Tap() *os.File { return a.tap }

// AttachVM wires a VM to the gateway with box.Policy, which must not be
// empty. With pid 0 the VM's namespace is a new one that the attachment
// holds, and the tap is handed over as a descriptor (Tap), so that the
// VMM needs neither a namespace of kiln's nor /dev/net/tun. With a pid,
// the namespace is that process's (the VMM, started in a namespace of
// its own, e.g. Firecracker), and TapName is made persistent there, for
// the VMM to open by name (it needs CAP_NET_ADMIN there, or to be root).
// Call it before the VMM opens its network device. The guest must be
// given the attachment's address and booted with VMNetwork's plan.
func (g *Gateway) AttachVM(ctx context.Context, pid int, box BoxInfo) (_ *VMAttachment, err error) {
	if box.Policy.Empty() {
		return nil, errors.New("attaching vm: the policy allows nothing; a VM without a network has no network device")
	}
	ns, err := vmNamespace(pid)
	if err != nil {
		return nil, err
	}
	// attachNS takes over ns; the bridge and tap need a handle of ours.
	fd, err := unix.FcntlInt(uintptr(ns), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		ns.Close()
		return nil, fmt.Errorf("holding vm namespace: %w", err)
	}
	own := netns.NsHandle(fd)
	a, err := g.attachNS(ctx, ns, box)
	if err != nil {
		own.Close()
		return nil, err
	}
	a.onClose(own.Close)
	defer func() {
		if err != nil {
			a.Close()
		}
	}()
	// The guest is booted with VMNetwork's plan, not with this
	// attachment's: they must agree.
	vn, env := g.VMNetwork(box.Policy, "")
	if a.resolvConf != vn.ResolvConf || !slices.Equal(a.env, env) {
		return nil, errors.New("attaching vm: the gateway's box environment differs from the VM plan's (egress.VMNetwork is out of date)")
	}
	tap, err := g.bridgeTap(own, a, pid == 0)
	if err != nil {
		return nil, err
	}
	return &VMAttachment{Attachment: a, tap: tap}, nil
}

// bridgeTap makes the tap in ns, bridged to the box's end of a's veth.
// fd says whether to keep the tap's descriptor (returned) or to make the
// tap persistent and close it.
func (g *Gateway) bridgeTap(ns netns.NsHandle, a *Attachment, fd bool) (*os.File, error) {
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("opening netlink in vm namespace: %w", err)
	}
	defer h.Close()
	err = netnsrun.In(ns, func() error {
		for _, k := range []string{"all", "default"} {
			if err := writeSysctl("net/ipv6/conf/"+k+"/disable_ipv6", "1"); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("configuring vm namespace: %w", err)
	}
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return nil, fmt.Errorf("finding vm eth0: %w", err)
	}
	if err := h.AddrDel(eth, &netlink.Addr{IPNet: hostNet(a.addr)}); err != nil {
		return nil, fmt.Errorf("moving the box address to the guest: %w", err)
	}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: vmBridge}}
	if err := h.LinkAdd(br); err != nil {
		return nil, fmt.Errorf("creating vm bridge: %w", err)
	}
	var tap *os.File
	err = netnsrun.In(ns, func() error {
		var err error
		tap, err = openTap(TapName, !fd)
		return err
	})
	if err != nil {
		return nil, err
	}
	if fd {
		a.onClose(tap.Close)
	} else {
		tap.Close()
		tap = nil
		// The namespace may outlive the attachment (it is the VMM's).
		a.onClose(func() error { return deleteLink(ns, TapName) })
	}
	tl, err := h.LinkByName(TapName)
	if err != nil {
		return nil, fmt.Errorf("finding vm tap: %w", err)
	}
	for _, l := range []netlink.Link{eth, tl} {
		if err := h.LinkSetMaster(l, br); err != nil {
			return nil, fmt.Errorf("bridging %s: %w", l.Attrs().Name, err)
		}
	}
	for _, l := range []netlink.Link{tl, br} {
		if err := h.LinkSetUp(l); err != nil {
			return nil, fmt.Errorf("bringing up %s: %w", l.Attrs().Name, err)
		}
	}
	return tap, nil
}

// deleteLink deletes the link name in ns, if it is there.
func deleteLink(ns netns.NsHandle, name string) error {
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("opening netlink: %w", err)
	}
	defer h.Close()
	l, err := h.LinkByName(name)
	if err != nil {
		return nil // gone with its VMM's namespace, or never made
	}
	if err := h.LinkDel(l); err != nil {
		return fmt.Errorf("deleting %s: %w", name, err)
	}
	return nil
}

// openTap creates the tap name in the calling thread's network namespace
// (call it inside inNetNS) and returns its queue; persistent taps stay
// when it is closed.
func openTap(name string, persist bool) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening /dev/net/tun: %w", err)
	}
	f := os.NewFile(uintptr(fd), "tap")
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("creating tap %s: %w", name, err)
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		f.Close()
		return nil, fmt.Errorf("creating tap %s: %w", name, err)
	}
	if persist {
		if err := unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1); err != nil {
			f.Close()
			return nil, fmt.Errorf("making tap %s persistent: %w", name, err)
		}
	}
	return f, nil
}

// VMNetwork is what a VM's guest is booted with under policy p
// (boxpolicy.Plan.Network and the plan's Env): the same for every box of
// this gateway and policy, so that one template VM serves them all; each
// box's address comes with its attachment. env is what Attachment.Env
// gives a box, and, when trustPath is set and the gateway has a secret
// for a host p allows, TrustEnv(trustPath): the guest is then sent the
// attachment's TrustBundle with its address.
func (g *Gateway) VMNetwork(p Policy, trustPath string) (boxpolicy.Network, []string) {
	proxy := proxyURL(g.gwIP.String(), g.opts.ProxyPort)
	noProxy := "localhost,127.0.0.1,::1"
	env := []string{
		"HTTP_PROXY=" + proxy, "HTTPS_PROXY=" + proxy, "NO_PROXY=" + noProxy,
		"http_proxy=" + proxy, "https_proxy=" + proxy, "no_proxy=" + noProxy,
	}
	n := boxpolicy.Network{
		Gateway:     g.gwIP.String(),
		Transparent: g.transIP.String(),
		ResolvConf:  "# kiln egress gateway: answers only names the policy allows\nnameserver " + g.gwIP.String() + "\noptions attempts:2 timeout:2\n",
	}
	if s := g.c.sec.envFor(p); len(s) > 0 {
		env = append(env, s...)
		if trustPath != "" {
			n.TrustBundle = true
			env = append(env, TrustEnv(trustPath)...)
		}
	}
	return n, env
}

// vmNamespace is a new network namespace (pid 0) or pid's.
func vmNamespace(pid int) (netns.NsHandle, error) {
	if pid == 0 {
		return netnsrun.New()
	}
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		return ns, fmt.Errorf("opening network namespace of pid %d: %w", pid, err)
	}
	return ns, nil
}

// LooseTap makes a tap, as AttachVM does, on no network: in a namespace
// of its own that holds nothing else (pid 0, returning its descriptor)
// or, persistent, in pid's. A template VM is booted with one, so that its
// clones, attached with AttachVM, have the network device they were
// saved with. Close removes it.
func LooseTap(pid int) (tap *os.File, closeFn func() error, err error) {
	ns, err := vmNamespace(pid)
	if err != nil {
		return nil, nil, err
	}
	err = netnsrun.In(ns, func() error {
		var err error
		tap, err = openTap(TapName, pid != 0)
		return err
	})
	if err != nil {
		ns.Close()
		return nil, nil, err
	}
	if pid == 0 {
		return tap, func() error { return errors.Join(tap.Close(), ns.Close()) }, nil
	}
	tap.Close()
	return nil, func() error { return errors.Join(deleteLink(ns, TapName), ns.Close()) }, nil
}
