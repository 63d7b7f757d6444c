package egress

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"strings"
	"testing"
)

// TestListenRefusals: a listening gateway attaches boxes by address only,
// never at its own or a loopback address, and a gateway that wires boxes
// itself attaches none by address; a listen address boxes could not use
// as their resolver is refused at start.
func TestListenRefusals(t *testing.T) {
	p, err := ParsePolicy("example.org")
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"127.0.0.1", "0.0.0.0", "::1"} {
		if _, err := NewGateway(Options{Listen: netip.MustParseAddr(bad)}); err == nil || !strings.Contains(err.Error(), "listen address") {
			t.Errorf("Listen %s: %v, want a refusal of the listen address", bad, err)
		}
	}
	if os.Geteuid() != 0 {
		t.Skip("the rest makes a gateway namespace: needs root")
	}
	ns, err := NewGateway(Options{})
	if err != nil {
		t.Skipf("the egress gateway cannot start here: %v", err)
	}
	defer ns.Close()
	if _, err := ns.AttachAddr(netip.MustParseAddr("10.0.0.5"), BoxInfo{Policy: p}); err == nil {
		t.Error("a namespace gateway attached a box by address")
	}
	// A listening gateway on the namespace gateway's own address, inside
	// nothing: only its attach rules are under test here (the Kubernetes
	// battery serves real boxes through one).
	l := &Gateway{c: ns.c, opts: Options{Listen: ns.gwIP}.withDefaults(), gwIP: ns.gwIP, attached: map[*Attachment]struct{}{}}
	if _, err := l.Attach(context.Background(), os.Getpid(), BoxInfo{Policy: p}); !errors.Is(err, errListening) {
		t.Errorf("Attach on a listening gateway: %v, want errListening", err)
	}
	for _, bad := range []string{"127.0.0.1", "0.0.0.0", ns.gwIP.String()} {
		if _, err := l.AttachAddr(netip.MustParseAddr(bad), BoxInfo{Policy: p}); err == nil {
			t.Errorf("AttachAddr(%s) was accepted", bad)
		}
	}
	a, err := l.AttachAddr(netip.MustParseAddr("10.0.0.5"), BoxInfo{Session: "s", Policy: p})
	if err != nil {
		t.Fatal(err)
	}
	if got := l.c.boxAtString("10.0.0.5:4000"); got != a {
		t.Errorf("the gateway does not know the box by its address (%v)", got)
	}
	if !strings.Contains(a.ResolvConf(), "nameserver "+ns.gwIP.String()) {
		t.Errorf("resolv.conf %q", a.ResolvConf())
	}
	a.Close()
	if got := l.c.boxAtString("10.0.0.5:4000"); got != nil {
		t.Error("a closed attachment still answers for its address")
	}
	if a, err := l.AttachAddr(netip.MustParseAddr("10.0.0.6"), BoxInfo{}); err != nil || a.Addr().IsValid() {
		t.Errorf("an empty policy attaches nothing: %v, %v", a, err)
	}
}
