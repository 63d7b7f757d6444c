//go:build linux

package egress

import (
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// The firewall rules are built from these few matchers; each function
// returns the expressions of one nft match, so a rule reads like nft's own
// syntax.

func ipv4() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
	}
}

func l4proto(p byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}},
	}
}

// ipDaddr matches an IPv4 destination; use after ipv4().
func ipDaddr(a netip.Addr) []expr.Any {
	b := a.As4()
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: b[:]},
	}
}

// dport matches a TCP or UDP destination port; use after l4proto().
func dport(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
	}
}

func ifname(key expr.MetaKey, name string) []expr.Any {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: b},
	}
}

// ifnamePrefix matches an interface whose name starts with prefix (nft's
// "kb*": the comparison covers only the prefix's bytes).
func ifnamePrefix(key expr.MetaKey, prefix string) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte(prefix)},
	}
}

func ctEstablishedOrRelated() []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED),
			Xor:  binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
	}
}

func accept() []expr.Any { return []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}} }

func dnatTo(a netip.Addr) []expr.Any {
	b := a.As4()
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: b[:]},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1},
	}
}

func rejectTCPReset() []expr.Any {
	return []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}}
}

func rejectAdminProhibited() []expr.Any {
	return []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED}}
}

func nftRule(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// chainSpec is one base chain of a table and its rules, in order.
type chainSpec struct {
	name     string
	typ      nftables.ChainType
	hook     *nftables.ChainHook
	priority *nftables.ChainPriority
	policy   nftables.ChainPolicy
	rules    [][]expr.Any
}

// installTable replaces table name (family inet) in ns with chains, in one
// netlink transaction.
func installTable(ns netns.NsHandle, name string, chains []chainSpec) error {
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return fmt.Errorf("opening nftables: %w", err)
	}
	t := &nftables.Table{Name: name, Family: nftables.TableFamilyINet}
	// Adding then deleting makes the delete succeed whether or not the
	// table exists, so this replaces any stale copy.
	conn.AddTable(t)
	conn.DelTable(t)
	conn.AddTable(t)
	for _, cs := range chains {
		policy := cs.policy
		ch := conn.AddChain(&nftables.Chain{
			Name: cs.name, Table: t, Type: cs.typ, Hooknum: cs.hook, Priority: cs.priority, Policy: &policy,
		})
		for _, exprs := range cs.rules {
			conn.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: exprs})
		}
	}
	if err := conn.Flush(); err != nil {
		return fmt.Errorf("installing nftables table %s: %w", name, err)
	}
	return nil
}

// deleteTable removes table name from ns.
func deleteTable(ns netns.NsHandle, name string) error {
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return fmt.Errorf("opening nftables: %w", err)
	}
	conn.DelTable(&nftables.Table{Name: name, Family: nftables.TableFamilyINet})
	if err := conn.Flush(); err != nil {
		return fmt.Errorf("deleting nftables table %s: %w", name, err)
	}
	return nil
}

// gatewayChains is the firewall of the gateway's own namespace: boxes may
// reach only the DNS responder, the proxy and the transparent listeners;
// nothing is forwarded; the gateway sends nothing but replies. It holds a
// box by itself, without the box's own firewall (boxChains), which a box
// whose packets never meet its namespace's netfilter (gVisor's netstack
// writes raw frames to its veth) does not have in effect: TCP from a box
// to any address but the gateway's is redirected to the transparent
// listener on the same port, as the box's firewall would, other TCP is
// reset and everything else rejected.
func gatewayChains(gw, trans netip.Addr, proxyPort uint16) []chainSpec {
	fromBox := func() []expr.Any { return ifnamePrefix(expr.MetaKeyIIFNAME, boxVethPrefix) }
	return []chainSpec{
		{
			name: "nat_prerouting", typ: nftables.ChainTypeNAT, hook: nftables.ChainHookPrerouting,
			priority: nftables.ChainPriorityNATDest, policy: nftables.ChainPolicyAccept,
			rules: [][]expr.Any{
				nftRule(fromBox(), ipv4(), ipDaddr(gw), accept()),
				nftRule(fromBox(), ipv4(), ipDaddr(trans), accept()),
				nftRule(fromBox(), ipv4(), l4proto(unix.IPPROTO_TCP), dnatTo(trans)),
			},
		},
		{
			name: "input", typ: nftables.ChainTypeFilter, hook: nftables.ChainHookInput,
			priority: nftables.ChainPriorityFilter, policy: nftables.ChainPolicyDrop,
			rules: [][]expr.Any{
				nftRule(ifname(expr.MetaKeyIIFNAME, "lo"), accept()),
				nftRule(ctEstablishedOrRelated(), accept()),
				nftRule(ipv4(), ipDaddr(gw), l4proto(unix.IPPROTO_UDP), dport(53), accept()),
				nftRule(ipv4(), ipDaddr(gw), l4proto(unix.IPPROTO_TCP), dport(53), accept()),
				nftRule(ipv4(), ipDaddr(gw), l4proto(unix.IPPROTO_TCP), dport(proxyPort), accept()),
				nftRule(ipv4(), ipDaddr(trans), l4proto(unix.IPPROTO_TCP), accept()),
				nftRule(fromBox(), l4proto(unix.IPPROTO_TCP), rejectTCPReset()),
				nftRule(fromBox(), rejectAdminProhibited()),
			},
		},
		{
			name: "forward", typ: nftables.ChainTypeFilter, hook: nftables.ChainHookForward,
			priority: nftables.ChainPriorityFilter, policy: nftables.ChainPolicyDrop,
		},
		{
			name: "output", typ: nftables.ChainTypeFilter, hook: nftables.ChainHookOutput,
			priority: nftables.ChainPriorityFilter, policy: nftables.ChainPolicyDrop,
			rules: [][]expr.Any{
				nftRule(ifname(expr.MetaKeyOIFNAME, "lo"), accept()),
				nftRule(ctEstablishedOrRelated(), accept()),
			},
		},
	}
}

// boxChains is the firewall inside a box's namespace. TCP to an allowed
// port on any address is redirected (DNAT) to the gateway's transparent
// listener on the same port; the box may send only that, DNS to the
// gateway and TCP to the gateway's proxy. Other TCP is reset and
// everything else (other UDP, ICMP, IPv6) rejected, so clients fail at once
// instead of hanging.
func boxChains(gw, trans netip.Addr, proxyPort uint16, ports []uint16) []chainSpec {
	nat := [][]expr.Any{
		nftRule(ifname(expr.MetaKeyOIFNAME, "lo"), accept()),
		nftRule(ipv4(), ipDaddr(gw), accept()),
		nftRule(ipv4(), ipDaddr(trans), accept()),
	}
	filter := [][]expr.Any{
		nftRule(ifname(expr.MetaKeyOIFNAME, "lo"), accept()),
		nftRule(ctEstablishedOrRelated(), accept()),
		nftRule(ipv4(), ipDaddr(gw), l4proto(unix.IPPROTO_UDP), dport(53), accept()),
		nftRule(ipv4(), ipDaddr(gw), l4proto(unix.IPPROTO_TCP), dport(53), accept()),
		nftRule(ipv4(), ipDaddr(gw), l4proto(unix.IPPROTO_TCP), dport(proxyPort), accept()),
	}
	for _, p := range ports {
		nat = append(nat, nftRule(ipv4(), l4proto(unix.IPPROTO_TCP), dport(p), dnatTo(trans)))
		filter = append(filter, nftRule(ipv4(), ipDaddr(trans), l4proto(unix.IPPROTO_TCP), dport(p), accept()))
	}
	filter = append(filter,
		nftRule(l4proto(unix.IPPROTO_TCP), rejectTCPReset()),
		rejectAdminProhibited(),
	)
	return []chainSpec{
		{
			name: "nat_output", typ: nftables.ChainTypeNAT, hook: nftables.ChainHookOutput,
			priority: nftables.ChainPriorityNATDest, policy: nftables.ChainPolicyAccept, rules: nat,
		},
		{
			name: "output", typ: nftables.ChainTypeFilter, hook: nftables.ChainHookOutput,
			priority: nftables.ChainPriorityFilter, policy: nftables.ChainPolicyDrop, rules: filter,
		},
	}
}
