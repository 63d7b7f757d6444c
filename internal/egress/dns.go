package egress

import (
	"context"
	"net/netip"
	"time"

	"github.com/miekg/dns"

	"kiln/internal/event"
)

// dnsTTL is the TTL of answers; short, so a box re-asks after the host's
// view changes.
const dnsTTL = 30

// serveDNS answers a box's query: A records, resolved on the host and
// checked like the proxy's destinations, for names the box's policy allows;
// empty answers for other record types of allowed names (the box has no
// IPv6 route, and the proxy needs nothing else); REFUSED for every other
// name, so nothing can be tunnelled through DNS.
func (c *core) serveDNS(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(req)
	m.RecursionAvailable = true
	if opt := req.IsEdns0(); opt != nil {
		m.SetEdns0(1232, false)
	}
	defer w.WriteMsg(m)

	a := c.boxAt(w.RemoteAddr())
	if a == nil || req.Opcode != dns.OpcodeQuery || len(req.Question) != 1 {
		m.Rcode = dns.RcodeRefused
		return
	}
	q := req.Question[0]
	name := normalizeName(q.Name)
	if a.cut.Load() {
		m.Rcode = dns.RcodeRefused
		c.refuse(a, Refusal{Via: "dns", Name: name, Reason: reasonCut})
		return
	}
	if p := a.Policy(); q.Qclass != dns.ClassINET || !p.AllowsName(name) {
		m.Rcode = dns.RcodeRefused
		c.refuse(a, Refusal{Via: "dns", Name: name, Reason: "not in the allowlist (allowed: " + p.String() + ")"})
		return
	}
	if q.Qtype != dns.TypeA {
		return // NODATA
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ok, blocked, err := c.resolveChecked(ctx, name)
	if err != nil {
		m.Rcode = dns.RcodeServerFailure
		c.warnLimited(a, time.Now(), "egress error", "session", a.session, "via", "dns", "name", name, "verdict", "error", "err", err)
		c.observe(a, "dns", name, 0, event.VerdictError, err.Error())
		return
	}
	var v4 []netip.Addr
	for _, addr := range ok {
		if addr.Is4() {
			v4 = append(v4, addr)
		}
	}
	if len(v4) == 0 {
		if len(ok) == 0 {
			m.Rcode = dns.RcodeRefused
			c.refuse(a, Refusal{Via: "dns", Name: name, Addr: blocked[0].addr, Reason: blockedReason(name, blocked)})
		}
		return
	}
	strs := make([]string, len(v4))
	for i, addr := range v4 {
		strs[i] = addr.String()
		m.Answer = append(m.Answer, &dns.A{
			Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: dnsTTL},
			A:   addr.AsSlice(),
		})
	}
	c.infoLimited(a, time.Now(), "egress allowed", "session", a.session, "via", "dns", "name", name, "addr", strs, "verdict", "allow")
	c.observe(a, "dns", name, 0, event.VerdictAllow, "")
}
