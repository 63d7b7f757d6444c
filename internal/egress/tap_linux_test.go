//go:build linux

package egress

import (
	"context"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"kiln/internal/netnsrun"
)

// tapNS is the network namespace of the tap behind f.
func tapNS(t *testing.T, f *os.File) netns.NsHandle {
	t.Helper()
	fd, err := unix.IoctlRetInt(int(f.Fd()), unix.TUNGETDEVNETNS)
	if err != nil {
		t.Skipf("skipping: the kernel does not tell a tap's namespace (TUNGETDEVNETNS): %v", err)
	}
	return netns.NsHandle(fd)
}

// TestAttachVM checks a VM's namespace as AttachVM leaves it (the tap
// and the box's end of the veth on one bridge, the box's address taken
// off the namespace's own eth0), and that a guest on that bridge that
// carries the box's address, routed as the plan says, reaches the
// gateway's proxy, while one with another address does not. A veth
// stands in for the VM on the bridge; the tap is what QEMU would get.
func TestAttachVM(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to create network namespaces, taps and nftables rules")
	}
	gw, err := NewGateway(Options{})
	if err != nil {
		t.Skipf("skipping: gateway unavailable: %v", err)
	}
	defer gw.Close()
	ctx := context.Background()
	if _, err := gw.AttachVM(ctx, 0, BoxInfo{Session: "empty"}); err == nil {
		t.Error("AttachVM with an empty policy made a network")
	}
	a, err := gw.AttachVM(ctx, 0, BoxInfo{Session: "vm", Policy: MustParsePolicy("example.test")})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if a.Tap() == nil {
		t.Fatal("no tap descriptor for a VM in a namespace of its own")
	}
	ifr, _ := unix.NewIfreq("")
	if err := unix.IoctlIfreq(int(a.Tap().Fd()), unix.TUNGETIFF, ifr); err != nil {
		t.Fatal(err)
	}
	if ifr.Name() != TapName || ifr.Uint16()&unix.IFF_TAP == 0 || ifr.Uint16()&unix.IFF_VNET_HDR == 0 {
		t.Errorf("tap %q flags %#x, want %s with IFF_TAP|IFF_VNET_HDR", ifr.Name(), ifr.Uint16(), TapName)
	}
	vmNS := tapNS(t, a.Tap())
	defer vmNS.Close()
	h, err := netlink.NewHandleAt(vmNS)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	br, err := h.LinkByName(vmBridge)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"eth0", TapName} {
		l, err := h.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if l.Attrs().MasterIndex != br.Attrs().Index {
			t.Errorf("%s is not on the bridge", name)
		}
		if addrs, _ := h.AddrList(l, unix.AF_INET); len(addrs) != 0 {
			t.Errorf("%s in the VM's namespace has %v: only the guest may answer for the box's address", name, addrs)
		}
	}

	// The stand-in guest.
	for _, tc := range []struct {
		name  string
		addr  netip.Addr
		reach bool
	}{
		{"own address", a.Addr(), true},
		{"forged address", a.Addr().Next(), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			guest, err := netnsrun.New()
			if err != nil {
				t.Fatal(err)
			}
			defer guest.Close()
			veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "gv0", MasterIndex: br.Attrs().Index}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(guest))}
			if err := h.LinkAdd(veth); err != nil {
				t.Fatal(err)
			}
			defer h.LinkDel(veth)
			gv, err := h.LinkByName("gv0")
			if err != nil {
				t.Fatal(err)
			}
			if err := h.LinkSetUp(gv); err != nil {
				t.Fatal(err)
			}
			if err := gw.configureBox(guest, tc.addr); err != nil {
				t.Fatal(err)
			}
			nw, _ := gw.VMNetwork(a.Policy(), "")
			var conn net.Conn
			err = netnsrun.In(guest, func() error {
				var err error
				conn, err = net.DialTimeout("tcp4", net.JoinHostPort(nw.Gateway, "3128"), 3*time.Second)
				return err
			})
			if tc.reach {
				if err != nil {
					t.Fatalf("the guest does not reach the gateway's proxy: %v", err)
				}
				defer conn.Close()
				conn.SetDeadline(time.Now().Add(5 * time.Second))
				conn.Write([]byte("GET http://elsewhere.test/ HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n"))
				b := make([]byte, 512)
				n, _ := conn.Read(b)
				if !strings.Contains(string(b[:n]), "403") {
					t.Errorf("the proxy answered %q, want a refusal", b[:n])
				}
			} else if err == nil {
				conn.Close()
				t.Error("a guest with an address the gateway did not give its box reached the gateway")
			}
		})
	}

	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	links, _ := gw.nl.LinkList()
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, boxVethPrefix) {
			t.Errorf("%s is still in the gateway after the VM's attachment closed", l.Attrs().Name)
		}
	}
}

// TestVMNetworkMatchesAttach: the plan a VM boots with gives the box what
// Attach gives a jailed box (AttachVM refuses to attach otherwise).
func TestVMNetworkMatchesAttach(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to create network namespaces")
	}
	gw, err := NewGateway(Options{})
	if err != nil {
		t.Skipf("skipping: gateway unavailable: %v", err)
	}
	defer gw.Close()
	ns, err := netnsrun.New()
	if err != nil {
		t.Fatal(err)
	}
	p := MustParsePolicy("example.test")
	a, err := gw.attachNS(context.Background(), ns, BoxInfo{Policy: p})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	nw, env := gw.VMNetwork(p, "/ca.pem")
	if nw.ResolvConf != a.ResolvConf() || strings.Join(env, "\n") != strings.Join(a.Env(), "\n") {
		t.Errorf("VMNetwork %q %q, Attach %q %q", nw.ResolvConf, env, a.ResolvConf(), a.Env())
	}
	if nw.Gateway != gw.GatewayAddr().String() || nw.TrustBundle {
		t.Errorf("VMNetwork %+v: want gateway %v and no trust bundle (no secrets)", nw, gw.GatewayAddr())
	}
}
