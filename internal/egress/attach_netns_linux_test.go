package egress

import (
	"context"
	"net"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// TestAttachNetNS checks the namespace made for a box without a process:
// its path names a namespace holding eth0 with the attachment's address and
// a default route to the gateway, the gateway knows the box by that
// address, and Close takes the path away and frees the address.
func TestAttachNetNS(t *testing.T) {
	requireNetNS(t)
	gw, err := NewGateway(Options{})
	if err != nil {
		t.Fatalf("NewGateway: %v", err)
	}
	defer gw.Close()
	p, err := ParsePolicy("example.org")
	if err != nil {
		t.Fatal(err)
	}
	a, path, err := gw.AttachNetNS(context.Background(), BoxInfo{Session: "s", Policy: p})
	if err != nil {
		t.Fatalf("AttachNetNS: %v", err)
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatalf("opening %s: %v", path, err)
	}
	self, _ := netns.Get()
	if ns.Equal(self) {
		t.Fatalf("%s is kiln's own network namespace", path)
	}
	self.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	eth, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatalf("no eth0 in the box's namespace: %v", err)
	}
	addrs, _ := h.AddrList(eth, netlink.FAMILY_V4)
	if len(addrs) != 1 || !addrs[0].IP.Equal(net.IP(a.Addr().AsSlice())) {
		t.Errorf("eth0 addresses %v, want only %v", addrs, a.Addr())
	}
	routes, _ := h.RouteList(eth, netlink.FAMILY_V4)
	var dflt bool
	for _, r := range routes {
		if r.Dst == nil || r.Dst.String() == "0.0.0.0/0" {
			dflt = r.Gw.Equal(net.IP(gw.GatewayAddr().AsSlice()))
		}
	}
	if !dflt {
		t.Errorf("no default route via %v: %v", gw.GatewayAddr(), routes)
	}
	h.Close()
	id := ns.UniqueId()
	ns.Close()
	if b := gw.c.boxAtString(a.Addr().String() + ":1"); b != a {
		t.Errorf("the gateway does not know the box by %v", a.Addr())
	}
	if err := a.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	// The fd may have been reused by now; it must not be the box's.
	if again, err := netns.GetFromPath(path); err == nil {
		if again.UniqueId() == id {
			t.Errorf("%s still names the box's namespace after Close", path)
		}
		again.Close()
	}
	if b := gw.c.boxAtString(a.Addr().String() + ":1"); b != nil {
		t.Errorf("the gateway still knows %v after Close", a.Addr())
	}

	// An empty policy makes nothing.
	a, path, err = gw.AttachNetNS(context.Background(), BoxInfo{Session: "none"})
	if err != nil || path != "" || a.Addr().IsValid() {
		t.Errorf("empty policy: %v %q %v, want no namespace", err, path, a.Addr())
	}
}
