package guestinit

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
)

// A guest with a network (boxpolicy.Plan.Network) has one virtio-net
// device, eth0, on a link that leads to the egress gateway and nowhere
// else (the host bridges it to the box's end of the gateway's veth). It
// boots with eth0 down and unaddressed, so a template VM has no address
// for its clones to share; each clone gets its own /32 with its seed
// (seedNetwork), with on-link routes to the gateway's two addresses and
// the default route via the first, as the gateway gives a jailed box.

// guestLink is the guest's network device.
const guestLink = "eth0"

// runDir holds the files PID 1 writes for the box (root's, read-only to
// code) and binds over the read-only root's.
const runDir = "/run/kiln"

// setupNetwork is stage 2's part for a box with a network: resolv.conf
// from the plan, and eth0 present, without IPv6, down until its address
// comes.
func setupNetwork(nw *boxpolicy.Network) error {
	if nw == nil {
		return nil
	}
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", runDir, err)
	}
	if err := bindRunFile("resolv.conf", "/etc/resolv.conf", []byte(nw.ResolvConf)); err != nil {
		return err
	}
	if err := waitFor("/sys/class/net/" + guestLink); err != nil {
		return fmt.Errorf("finding the network device (is virtio_net in the image's modules?): %w", err)
	}
	for _, k := range []string{"all", "default", guestLink} {
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+k+"/disable_ipv6", []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("disabling IPv6 on %s: %w", k, err)
		}
	}
	return nil
}

// bindRunFile writes data to runDir/name and binds it read-only over
// target, which the image must have as a mount point.
func bindRunFile(name, target string, data []byte) error {
	src := runDir + "/" + name
	if err := os.WriteFile(src, data, 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", src, err)
	}
	if _, err := os.Stat(target); err != nil {
		return fmt.Errorf("binding %s: the image has no %s to bind over (rebuild it with kiln image build): %w", name, target, err)
	}
	// Bound once: a second seed rewrites the file under the bind.
	if mounted(target) {
		return nil
	}
	return doBind(mount{src, target, "", msBind | msRdonly | msNosuid | msNodev | msNoexec, ""})
}

// mounted reports whether path is a mount point.
func mounted(path string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == path {
			return true
		}
	}
	return false
}

// installTrustBundle puts the gateway's trust bundle at
// boxpolicy.TrustBundle.
func installTrustBundle(b []byte) error {
	return bindRunFile("egress-ca.pem", boxpolicy.TrustBundle, b)
}

// configureNetwork addresses eth0 with addr/32, brings it up and routes
// the gateway's two addresses on-link, and everything else via the
// gateway.
func configureNetwork(addr netip.Addr, nw *boxpolicy.Network) error {
	gw, err := netip.ParseAddr(nw.Gateway)
	if err != nil || !gw.Is4() {
		return fmt.Errorf("configuring network: gateway address %q", nw.Gateway)
	}
	trans, err := netip.ParseAddr(nw.Transparent)
	if err != nil || !trans.Is4() {
		return fmt.Errorf("configuring network: transparent address %q", nw.Transparent)
	}
	if !addr.Is4() {
		return fmt.Errorf("configuring network: box address %v is not IPv4", addr)
	}
	ifc, err := net.InterfaceByName(guestLink)
	if err != nil {
		return fmt.Errorf("configuring network: %w", err)
	}
	nl, err := dialRoute()
	if err != nil {
		return err
	}
	defer nl.close()
	idx := uint32(ifc.Index)
	if err := nl.addAddr(idx, addr); err != nil {
		return fmt.Errorf("addressing %s: %w", guestLink, err)
	}
	if err := linkUp(guestLink); err != nil {
		return err
	}
	for _, a := range []netip.Addr{gw, trans} {
		if err := nl.addRoute(idx, a, 32, netip.Addr{}); err != nil {
			return fmt.Errorf("routing to %v: %w", a, err)
		}
	}
	if err := nl.addRoute(idx, netip.IPv4Unspecified(), 0, gw); err != nil {
		return fmt.Errorf("adding default route: %w", err)
	}
	return nil
}

// routeConn is a NETLINK_ROUTE socket that sends one request at a time
// and waits for its acknowledgement.
type routeConn struct {
	fd  int
	seq uint32
}

func dialRoute() (*routeConn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("opening netlink: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("opening netlink: %w", err)
	}
	return &routeConn{fd: fd}, nil
}

func (c *routeConn) close() { unix.Close(c.fd) }

// addAddr adds addr/32 to link idx (replacing it if there).
func (c *routeConn) addAddr(idx uint32, addr netip.Addr) error {
	a := addr.As4()
	// struct ifaddrmsg: family, prefixlen, flags, scope, index.
	body := []byte{unix.AF_INET, 32, 0, unix.RT_SCOPE_UNIVERSE, 0, 0, 0, 0}
	binary.NativeEndian.PutUint32(body[4:], idx)
	body = rtattr(body, unix.IFA_LOCAL, a[:])
	body = rtattr(body, unix.IFA_ADDRESS, a[:])
	return c.request(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, body)
}

// addRoute adds a route to dst/bits on link idx: on-link without via,
// through via otherwise.
func (c *routeConn) addRoute(idx uint32, dst netip.Addr, bits int, via netip.Addr) error {
	scope := byte(unix.RT_SCOPE_LINK)
	if via.IsValid() {
		scope = unix.RT_SCOPE_UNIVERSE
	}
	// struct rtmsg: family, dst_len, src_len, tos, table, protocol,
	// scope, type, flags.
	body := []byte{unix.AF_INET, byte(bits), 0, 0, unix.RT_TABLE_MAIN, unix.RTPROT_BOOT, scope, unix.RTN_UNICAST, 0, 0, 0, 0}
	if bits > 0 {
		d := dst.As4()
		body = rtattr(body, unix.RTA_DST, d[:])
	}
	if via.IsValid() {
		v := via.As4()
		body = rtattr(body, unix.RTA_GATEWAY, v[:])
	}
	oif := make([]byte, 4)
	binary.NativeEndian.PutUint32(oif, idx)
	body = rtattr(body, unix.RTA_OIF, oif)
	return c.request(unix.RTM_NEWROUTE, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, body)
}

// rtattr appends one route attribute to b, padded to 4 bytes.
func rtattr(b []byte, typ uint16, data []byte) []byte {
	h := make([]byte, unix.SizeofRtAttr)
	binary.NativeEndian.PutUint16(h, uint16(unix.SizeofRtAttr+len(data)))
	binary.NativeEndian.PutUint16(h[2:], typ)
	b = append(append(b, h...), data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// request sends one message and returns the kernel's answer to it.
func (c *routeConn) request(typ, flags uint16, body []byte) error {
	c.seq++
	msg := make([]byte, unix.SizeofNlMsghdr, unix.SizeofNlMsghdr+len(body))
	binary.NativeEndian.PutUint32(msg, uint32(unix.SizeofNlMsghdr+len(body)))
	binary.NativeEndian.PutUint16(msg[4:], typ)
	binary.NativeEndian.PutUint16(msg[6:], flags|unix.NLM_F_REQUEST|unix.NLM_F_ACK)
	binary.NativeEndian.PutUint32(msg[8:], c.seq)
	msg = append(msg, body...)
	if err := unix.Sendto(c.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := unix.Recvfrom(c.fd, buf, 0)
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Seq != c.seq || m.Header.Type != unix.NLMSG_ERROR || len(m.Data) < 4 {
				continue
			}
			if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
				return unix.Errno(-e)
			}
			return nil
		}
	}
}

// linkUp sets the up flag of the named link.
func linkUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("bringing up %s: %w", name, err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return fmt.Errorf("bringing up %s: %w", name, err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bringing up %s: %w", name, err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bringing up %s: %w", name, err)
	}
	return nil
}
