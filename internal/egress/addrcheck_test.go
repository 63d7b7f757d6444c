package egress

import (
	"net/netip"
	"testing"
)

// TestBlockedRanges checks a victim address in every row of blockedRanges,
// the addresses the issue names, and that public addresses pass.
func TestBlockedRanges(t *testing.T) {
	c, err := newAddrChecker(nil)
	if err != nil {
		t.Fatal(err)
	}
	c.hostAddrs = func() ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("198.51.100.7"), netip.MustParseAddr("2a00:1450::7"), netip.MustParseAddr("93.184.215.14")}, nil
	}
	for _, r := range blockedRanges {
		victim := r.prefix.Addr()
		if r.prefix.Bits() < victim.BitLen() {
			victim = victim.Next() // a host inside, not only the network address
		}
		if why := c.check(victim); why == "" {
			t.Errorf("%v (in %v, %s) allowed", victim, r.prefix, r.why)
		}
	}
	blocked := []string{
		"169.254.169.254", "127.0.0.1", "127.1.2.3", "10.0.0.1", "10.77.0.3", "172.16.5.4", "172.31.255.255",
		"192.168.1.1", "100.64.0.1", "100.127.255.254", "0.0.0.0", "224.0.0.1", "255.255.255.255",
		"::", "::1", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1",
		"::ffff:169.254.169.254", "::ffff:127.0.0.1", "::ffff:10.0.0.1", // IPv4-mapped
		"64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1", // NAT64 of metadata and loopback
		"2002:a9fe:a9fe::1", "2002:0a00:0001::1", // 6to4 of metadata and 10.0.0.1
		"fe80::1%eth0",
		"93.184.215.14", "2a00:1450::7", // the host's own addresses
	}
	for _, s := range blocked {
		if why := c.check(netip.MustParseAddr(s)); why == "" {
			t.Errorf("%s allowed", s)
		} else {
			t.Logf("%s: %s", s, why)
		}
	}
	for _, s := range []string{"93.184.215.15", "1.1.1.1", "8.8.8.8", "172.32.0.1", "100.128.0.1", "2a00:1450::8", "64:ff9b::808:808", "2606:4700::1111"} {
		if why := c.check(netip.MustParseAddr(s)); why != "" {
			t.Errorf("%s refused: %s", s, why)
		}
	}
}

func TestTestOnlyAllowedAddrs(t *testing.T) {
	c, err := newAddrChecker([]netip.Prefix{netip.MustParsePrefix("10.77.0.2/32"), netip.MustParsePrefix("fd00:77::/64")})
	if err != nil {
		t.Fatal(err)
	}
	c.hostAddrs = func() ([]netip.Addr, error) { return nil, nil }
	for _, s := range []string{"10.77.0.2", "fd00:77::5"} {
		if why := c.check(netip.MustParseAddr(s)); why != "" {
			t.Errorf("listed %s refused: %s", s, why)
		}
	}
	for _, s := range []string{"10.77.0.3", "10.0.0.1", "127.0.0.1", "169.254.169.254", "fd00:78::1"} {
		if why := c.check(netip.MustParseAddr(s)); why == "" {
			t.Errorf("unlisted %s allowed", s)
		}
	}
	for _, bad := range []string{"127.0.0.1/32", "169.254.169.254/32", "169.254.0.0/16", "0.0.0.0/0", "8.8.8.8/32", "10.0.0.0/7", "fe80::/64", "::1/128", "224.0.0.1/32"} {
		if _, err := newAddrChecker([]netip.Prefix{netip.MustParsePrefix(bad)}); err == nil {
			t.Errorf("TestOnlyAllowedAddrs accepted %s", bad)
		}
	}
}
