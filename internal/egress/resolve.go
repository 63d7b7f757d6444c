package egress

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"

	"kiln/internal/config"
)

// resolver looks names up on the host: first in the gateway's own hosts
// map (Options.Hosts, Options.HostsFile), which is authoritative for the
// names it holds, then through DNS as the host sees it.
type resolver struct {
	hosts map[string][]netip.Addr
	dns   *net.Resolver
}

func newResolver(opts Options) (*resolver, error) {
	r := &resolver{hosts: map[string][]netip.Addr{}, dns: opts.Resolver}
	if r.dns == nil {
		r.dns = net.DefaultResolver
	}
	if opts.HostsFile != "" {
		// The file decides where an allowed name goes.
		f, err := config.OpenTrusted("egress hosts file", opts.HostsFile, false)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		m, err := ParseHosts(f)
		if err != nil {
			return nil, fmt.Errorf("reading hosts file %s: %w", opts.HostsFile, err)
		}
		for name, addrs := range m {
			r.add(name, addrs)
		}
	}
	for name, addrs := range opts.Hosts {
		r.add(name, addrs)
	}
	return r, nil
}

func (r *resolver) add(name string, addrs []netip.Addr) {
	name = normalizeName(name)
	for _, a := range addrs {
		if !slices.Contains(r.hosts[name], a) {
			r.hosts[name] = append(r.hosts[name], a)
		}
	}
}

func (r *resolver) lookup(ctx context.Context, name string) ([]netip.Addr, error) {
	name = normalizeName(name)
	if addrs, ok := r.hosts[name]; ok {
		return slices.Clone(addrs), nil
	}
	addrs, err := r.dns.LookupNetIP(ctx, "ip", name)
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w", name, err)
	}
	for i, a := range addrs {
		addrs[i] = a.Unmap()
	}
	return addrs, nil
}

// ParseHosts reads a file in /etc/hosts format ("address name [name…]",
// '#' starts a comment) into a map from lower-case name to addresses.
func ParseHosts(f io.Reader) (map[string][]netip.Addr, error) {
	m := map[string][]netip.Addr{}
	sc := bufio.NewScanner(f)
	line := 0
	for sc.Scan() {
		line++
		text, _, _ := strings.Cut(sc.Text(), "#")
		fields := strings.Fields(text)
		if len(fields) == 0 {
			continue
		}
		addr, err := netip.ParseAddr(fields[0])
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		if len(fields) < 2 {
			return nil, fmt.Errorf("line %d: address without a name", line)
		}
		for _, name := range fields[1:] {
			name = normalizeName(name)
			if !slices.Contains(m[name], addr) {
				m[name] = append(m[name], addr)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return m, nil
}
