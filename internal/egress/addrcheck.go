package egress

import (
	"fmt"
	"net"
	"net/netip"
)

// blockedRange is a destination range the gateway never dials, whatever
// name resolved to it.
type blockedRange struct {
	prefix netip.Prefix
	why    string
	// testExemptable ranges may be opened for listed addresses by
	// Options.TestOnlyAllowedAddrs (private ranges that a test's local
	// "internet" lives in). Loopback, link-local (metadata) and the like
	// never are.
	testExemptable bool
}

// blockedRanges is the security policy for resolved destinations, as data.
// addrcheck_test.go holds a case for every row. IPv4-mapped IPv6 addresses
// are unmapped first, and the IPv4 address inside NAT64 and 6to4 addresses
// is checked against this table too.
var blockedRanges = []blockedRange{
	{mustPrefix("0.0.0.0/8"), "unspecified (\"this network\")", false},
	{mustPrefix("127.0.0.0/8"), "loopback", false},
	{mustPrefix("169.254.0.0/16"), "link-local (cloud metadata service)", false},
	{mustPrefix("10.0.0.0/8"), "private (RFC 1918)", true},
	{mustPrefix("172.16.0.0/12"), "private (RFC 1918)", true},
	{mustPrefix("192.168.0.0/16"), "private (RFC 1918)", true},
	{mustPrefix("100.64.0.0/10"), "shared address space (CGNAT)", true},
	{mustPrefix("192.0.0.0/24"), "IETF protocol assignments", false},
	{mustPrefix("192.0.2.0/24"), "documentation (TEST-NET-1)", true},
	{mustPrefix("198.51.100.0/24"), "documentation (TEST-NET-2)", true},
	{mustPrefix("203.0.113.0/24"), "documentation (TEST-NET-3)", true},
	{mustPrefix("198.18.0.0/15"), "benchmarking", true},
	{mustPrefix("224.0.0.0/4"), "multicast", false},
	{mustPrefix("240.0.0.0/4"), "reserved and broadcast", false},

	{mustPrefix("::/128"), "unspecified", false},
	{mustPrefix("::1/128"), "loopback", false},
	{mustPrefix("::/96"), "IPv4-compatible (deprecated)", false},
	{mustPrefix("64:ff9b:1::/48"), "local-use NAT64", false},
	{mustPrefix("100::/64"), "discard-only", false},
	{mustPrefix("2001::/32"), "Teredo", false},
	{mustPrefix("2001:db8::/32"), "documentation", true},
	{mustPrefix("fc00::/7"), "unique local (ULA)", true},
	{mustPrefix("fe80::/10"), "link-local", false},
	{mustPrefix("fec0::/10"), "site-local (deprecated)", false},
	{mustPrefix("ff00::/8"), "multicast", false},
}

var (
	nat64Prefix = mustPrefix("64:ff9b::/96")
	sixToFour   = mustPrefix("2002::/16")
)

func mustPrefix(s string) netip.Prefix { return netip.MustParsePrefix(s) }

// addrChecker decides whether the gateway may dial an address.
type addrChecker struct {
	// testAllowed are the addresses of Options.TestOnlyAllowedAddrs.
	testAllowed []netip.Prefix
	// hostAddrs returns the host's own interface addresses.
	hostAddrs func() ([]netip.Addr, error)
}

func newAddrChecker(testAllowed []netip.Prefix) (*addrChecker, error) {
	for _, p := range testAllowed {
		if !exemptable(p) {
			return nil, fmt.Errorf("checking TestOnlyAllowedAddrs: %v is not inside a private or documentation range; loopback, link-local, multicast and public ranges cannot be exempted", p)
		}
	}
	return &addrChecker{testAllowed: testAllowed, hostAddrs: interfaceAddrs}, nil
}

// exemptable reports whether p lies wholly inside a test-exemptable range.
func exemptable(p netip.Prefix) bool {
	p = p.Masked()
	for _, r := range blockedRanges {
		if r.prefix.Overlaps(p) {
			return r.testExemptable && p.Bits() >= r.prefix.Bits()
		}
	}
	return false
}

// check returns "" if the gateway may dial a, or why it may not.
func (c *addrChecker) check(a netip.Addr) string {
	a = a.Unmap().WithZone("")
	if !a.IsValid() {
		return "invalid address"
	}
	if a.Is6() {
		var inner netip.Addr
		b := a.As16()
		switch {
		case nat64Prefix.Contains(a):
			inner = netip.AddrFrom4([4]byte(b[12:16]))
		case sixToFour.Contains(a):
			inner = netip.AddrFrom4([4]byte(b[2:6]))
		}
		if inner.IsValid() {
			if why := c.check(inner); why != "" {
				return "embeds " + inner.String() + ", " + why
			}
		}
	}
	for _, r := range blockedRanges {
		if !r.prefix.Contains(a) {
			continue
		}
		if r.testExemptable && c.isTestAllowed(a) {
			break
		}
		return r.why
	}
	if c.hostAddrs != nil {
		own, err := c.hostAddrs()
		if err != nil {
			return "cannot list the host's own addresses to rule them out"
		}
		for _, o := range own {
			if o.Unmap().WithZone("") == a {
				return "one of the host's own addresses"
			}
		}
	}
	return ""
}

func (c *addrChecker) isTestAllowed(a netip.Addr) bool {
	for _, p := range c.testAllowed {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// interfaceAddrs lists the addresses of the network namespace the process
// runs in, which is where the gateway dials from.
func interfaceAddrs() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("listing interface addresses: %w", err)
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out, nil
}
