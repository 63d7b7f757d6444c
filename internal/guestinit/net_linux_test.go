package guestinit

import (
	"net"
	"net/netip"
	"os"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"

	"kiln/internal/boxpolicy"
	"kiln/internal/netnsrun"
)

// TestConfigureNetwork runs the guest's network setup in a namespace of
// the test's own, on a dummy eth0, and checks what the gateway expects of
// a box: its /32, on-link routes to the gateway's two addresses and the
// default route via the first; a seed with an address for a plan without
// a network, or a trust bundle the plan does not expect, is refused.
func TestConfigureNetwork(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to create a network namespace")
	}
	ns, err := netnsrun.New()
	if err != nil {
		t.Skipf("skipping: cannot create a network namespace: %v", err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	// A veth stands in for the virtio NIC; its peer is the host's side.
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: guestLink}, PeerName: "peer0"}); err != nil {
		t.Fatal(err)
	}
	if peer, err := h.LinkByName("peer0"); err != nil || h.LinkSetUp(peer) != nil {
		t.Fatalf("bringing up the peer: %v", err)
	}
	nw := &boxpolicy.Network{Gateway: "10.201.0.1", Transparent: "10.201.0.2"}
	addr := netip.MustParseAddr("10.201.0.7")
	for _, bad := range []struct {
		seed Seed
		nw   *boxpolicy.Network
	}{
		{Seed{Addr: addr.As4()}, nil},
		{Seed{Addr: addr.As4(), TrustBundle: []byte("pem")}, nw},
		{Seed{TrustBundle: []byte("pem")}, nw},
	} {
		if err := seedNetwork(bad.seed, bad.nw); err == nil {
			t.Errorf("seed %+v on plan network %+v accepted", bad.seed, bad.nw)
		}
	}
	if err := seedNetwork(Seed{}, nil); err != nil {
		t.Errorf("a seed without a network: %v", err)
	}
	err = netnsrun.In(ns, func() error { return seedNetwork(Seed{Addr: addr.As4()}, nw) })
	if err != nil {
		t.Fatal(err)
	}
	l, err := h.LinkByName(guestLink)
	if err != nil {
		t.Fatal(err)
	}
	if l.Attrs().Flags&net.FlagUp == 0 {
		t.Error("eth0 is down")
	}
	addrs, _ := h.AddrList(l, netlink.FAMILY_V4)
	if len(addrs) != 1 || addrs[0].IPNet.String() != "10.201.0.7/32" {
		t.Errorf("eth0 addresses %v, want 10.201.0.7/32", addrs)
	}
	routes, _ := h.RouteList(l, netlink.FAMILY_V4)
	var got []string
	for _, r := range routes {
		switch {
		case r.Dst == nil || r.Dst.String() == "0.0.0.0/0":
			got = append(got, "default via "+r.Gw.String())
		case r.Scope == netlink.SCOPE_LINK:
			got = append(got, r.Dst.String()+" link")
		}
	}
	slices.Sort(got)
	if want := []string{"10.201.0.1/32 link", "10.201.0.2/32 link", "default via 10.201.0.1"}; !slices.Equal(got, want) {
		t.Errorf("routes %q, want %q", got, want)
	}
}
