package cli

import (
	"fmt"
	"sort"
	"strings"

	"kiln/internal/egress"
	"kiln/internal/mcpserver"
)

// principalNets are the operator's allowlists by principal
// (--allow-net-for): each within --allow-net, which every box is made
// under; a call of a named principal runs in a box narrowed to its own.
// "*" names every principal not named.
type principalNets map[string]egress.Policy

// parsePrincipalNets reads --allow-net-for: PRINCIPAL=HOSTS entries
// separated by semicolons, HOSTS as --allow-net takes them (empty: no
// network for that principal).
func parsePrincipalNets(spec string, server egress.Policy) (principalNets, error) {
	if strings.TrimSpace(spec) == "" {
		return nil, nil
	}
	if server.Empty() {
		return nil, fmt.Errorf("--allow-net-for narrows --allow-net, which is empty: set --allow-net to every host any principal may reach")
	}
	nets := principalNets{}
	for _, entry := range strings.Split(spec, ";") {
		if entry = strings.TrimSpace(entry); entry == "" {
			continue
		}
		who, hosts, ok := strings.Cut(entry, "=")
		who = strings.TrimSpace(who)
		if !ok || who == "" {
			return nil, fmt.Errorf("--allow-net-for: %q is not PRINCIPAL=HOSTS (HOSTS comma-separated, entries separated by ;)", entry)
		}
		if _, dup := nets[who]; dup {
			return nil, fmt.Errorf("--allow-net-for: %s is named twice", who)
		}
		p, err := egress.ParsePolicy(splitList(hosts)...)
		if err != nil {
			return nil, fmt.Errorf("--allow-net-for: %s: %w", who, err)
		}
		if n := server.Narrow(p); !n.Equal(p) {
			part := "none of it"
			if !n.Empty() {
				part = "only " + n.String() + " of it"
			}
			return nil, fmt.Errorf("--allow-net-for: %s is given %s, but --allow-net (%s) allows %s: every box is made under --allow-net, so add the rest there or drop it here", who, p, server, part)
		}
		nets[who] = p
	}
	return nets, nil
}

func orNone(p egress.Policy) string {
	if p.Empty() {
		return "none"
	}
	return p.String()
}

// lookup is mcpserver.Options.NetworkFor.
func (n principalNets) lookup(principal string) (mcpserver.PrincipalNetwork, bool) {
	p, ok := n[principal]
	if !ok {
		if p, ok = n["*"]; !ok {
			return mcpserver.PrincipalNetwork{}, false
		}
	}
	pn := mcpserver.PrincipalNetwork{Hosts: p.Entries()}
	if !p.Empty() {
		pn.Describe = egress.Describe(p) + " (the operator's allowlist for this client)"
	}
	return pn, true
}

// String lists the allowlists for the log, principals sorted.
func (n principalNets) String() string {
	names := make([]string, 0, len(n))
	for who := range n {
		names = append(names, who)
	}
	sort.Strings(names)
	var b strings.Builder
	for i, who := range names {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s=%s", who, orNone(n[who]))
	}
	return b.String()
}
