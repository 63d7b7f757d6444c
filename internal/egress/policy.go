package egress

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// DefaultPorts are the ports an entry without ":port" allows.
var DefaultPorts = []uint16{80, 443}

// ErrInvalidPolicy is wrapped by every policy parsing error.
var ErrInvalidPolicy = errors.New("egress: invalid policy entry")

// Policy is an allowlist of destinations a box may reach through the
// gateway, by name and port. The zero Policy is empty: the box has only
// loopback.
//
// Entries are written `host`, `*.domain`, `host:port` or `*.domain:port`.
// `*.domain` matches every name below domain (a.domain, a.b.domain) but not
// domain itself; list both to allow both. Without a port an entry allows
// DefaultPorts. IP addresses are not accepted: the gateway allows by name
// only, and resolves the name itself.
//
// A Policy is immutable; its methods are safe for concurrent use.
type Policy struct {
	rules []rule // sorted, unique
}

// rule allows one name pattern on one port.
type rule struct {
	name     string // lower case, no trailing dot; for a wildcard, the domain below which names match
	wildcard bool
	port     uint16
}

func (r rule) matches(name string) bool {
	if r.wildcard {
		return strings.HasSuffix(name, "."+r.name)
	}
	return name == r.name
}

func (r rule) pattern() string {
	if r.wildcard {
		return "*." + r.name
	}
	return r.name
}

func compareRules(a, b rule) int {
	if c := strings.Compare(a.name, b.name); c != 0 {
		return c
	}
	if a.wildcard != b.wildcard {
		if a.wildcard {
			return 1
		}
		return -1
	}
	return int(a.port) - int(b.port)
}

func newPolicy(rules []rule) Policy {
	slices.SortFunc(rules, compareRules)
	return Policy{rules: slices.Compact(rules)}
}

// ParsePolicy parses allowlist entries, as given to --allow-net or in the
// configuration. Entries may also be comma-separated within one string.
func ParsePolicy(entries ...string) (Policy, error) {
	var rules []rule
	for _, e := range entries {
		for item := range strings.SplitSeq(e, ",") {
			item = strings.TrimSpace(item)
			if item == "" {
				continue
			}
			rs, err := parseEntry(item)
			if err != nil {
				return Policy{}, err
			}
			rules = append(rules, rs...)
		}
	}
	return newPolicy(rules), nil
}

// MustParsePolicy is ParsePolicy for constants; it panics on error.
func MustParsePolicy(entries ...string) Policy {
	p, err := ParsePolicy(entries...)
	if err != nil {
		panic(err)
	}
	return p
}

func parseEntry(s string) ([]rule, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w %q: %s", ErrInvalidPolicy, s, fmt.Sprintf(format, args...))
	}
	host, ports := s, DefaultPorts
	if strings.HasPrefix(host, "[") {
		return nil, bad("IP addresses are not accepted; allow a host name")
	}
	if i := strings.LastIndexByte(s, ':'); i >= 0 {
		host = s[:i]
		p, err := strconv.ParseUint(s[i+1:], 10, 16)
		if err != nil || p == 0 {
			return nil, bad("port must be a number from 1 to 65535")
		}
		ports = []uint16{uint16(p)}
	}
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	wildcard := false
	if rest, ok := strings.CutPrefix(host, "*."); ok {
		wildcard, host = true, rest
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return nil, bad("IP addresses are not accepted; allow a host name")
	}
	if err := checkHostName(host); err != nil {
		return nil, bad("%v", err)
	}
	rules := make([]rule, 0, len(ports))
	for _, p := range ports {
		rules = append(rules, rule{name: host, wildcard: wildcard, port: p})
	}
	return rules, nil
}

// checkHostName accepts DNS names made of letters, digits, '-' and '_'.
func checkHostName(h string) error {
	if h == "" {
		return errors.New("empty host name")
	}
	if len(h) > 253 {
		return errors.New("host name longer than 253 characters")
	}
	for label := range strings.SplitSeq(h, ".") {
		if label == "" || len(label) > 63 {
			return errors.New("each label of a host name must have 1 to 63 characters")
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return errors.New("a label of a host name cannot begin or end with '-'")
		}
		for _, c := range []byte(label) {
			ok := 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_'
			if !ok {
				return fmt.Errorf("character %q not allowed in a host name (wildcards only as a leading \"*.\")", c)
			}
		}
	}
	return nil
}

// normalizeName lower-cases a host name and drops a trailing dot.
func normalizeName(name string) string {
	return strings.TrimSuffix(strings.ToLower(name), ".")
}

// Empty reports whether the policy allows nothing (loopback only).
func (p Policy) Empty() bool { return len(p.rules) == 0 }

// Allows reports whether the policy allows connecting to name on port.
func (p Policy) Allows(name string, port uint16) bool {
	name = normalizeName(name)
	for _, r := range p.rules {
		if r.port == port && r.matches(name) {
			return true
		}
	}
	return false
}

// AllowsName reports whether the policy allows name on some port; the DNS
// responder answers only such names.
func (p Policy) AllowsName(name string) bool {
	name = normalizeName(name)
	for _, r := range p.rules {
		if r.matches(name) {
			return true
		}
	}
	return false
}

// Ports returns the ports the policy allows on any name, sorted.
func (p Policy) Ports() []uint16 {
	var ports []uint16
	for _, r := range p.rules {
		ports = append(ports, r.port)
	}
	slices.Sort(ports)
	return slices.Compact(ports)
}

// Narrow returns the destinations allowed by both p and other: the most a
// session asking for other may get when the server allows p. The result
// never allows anything p does not, so a session can narrow the server's
// policy but never widen it.
func (p Policy) Narrow(other Policy) Policy {
	var rules []rule
	for _, a := range p.rules {
		for _, b := range other.rules {
			if a.port != b.port {
				continue
			}
			if r, ok := intersect(a, b); ok {
				rules = append(rules, r)
			}
		}
	}
	return newPolicy(rules)
}

// intersect returns the rule matching exactly the names both a and b match,
// if there are any. The set of names a pattern matches is either one name or
// every name below a domain, so the intersection is always one of a or b.
func intersect(a, b rule) (rule, bool) {
	switch {
	case !a.wildcard && !b.wildcard:
		return a, a.name == b.name
	case !a.wildcard:
		return a, b.matches(a.name)
	case !b.wildcard:
		return b, a.matches(b.name)
	case a.name == b.name || strings.HasSuffix(b.name, "."+a.name):
		return b, true
	case strings.HasSuffix(a.name, "."+b.name):
		return a, true
	}
	return rule{}, false
}

// Entries returns the policy in canonical entry form: one entry per
// pattern for the default ports and one per pattern and other port.
// ParsePolicy(p.Entries()...) equals p.
func (p Policy) Entries() []string {
	var out []string
	for i := 0; i < len(p.rules); {
		j := i
		var ports []uint16
		for j < len(p.rules) && p.rules[j].name == p.rules[i].name && p.rules[j].wildcard == p.rules[i].wildcard {
			ports = append(ports, p.rules[j].port)
			j++
		}
		pat := p.rules[i].pattern()
		rest := ports
		if hasAll(ports, DefaultPorts) {
			out = append(out, pat)
			rest = slices.DeleteFunc(slices.Clone(ports), func(x uint16) bool { return slices.Contains(DefaultPorts, x) })
		}
		for _, port := range rest {
			out = append(out, pat+":"+strconv.Itoa(int(port)))
		}
		i = j
	}
	return out
}

func hasAll(have, want []uint16) bool {
	for _, w := range want {
		if !slices.Contains(have, w) {
			return false
		}
	}
	return true
}

// String returns the entries separated by ", ", or "none (loopback only)";
// tool descriptions use it to tell the model which hosts are reachable.
func (p Policy) String() string {
	if p.Empty() {
		return "none (loopback only)"
	}
	return strings.Join(p.Entries(), ", ")
}

// Equal reports whether p and q allow the same destinations.
func (p Policy) Equal(q Policy) bool { return slices.Equal(p.rules, q.rules) }
