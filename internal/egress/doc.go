// Package egress is kiln's network boundary for sandboxes: deny by default,
// allow by domain name, enforced below the box's code.
//
// # Shape
//
// A Gateway owns a network namespace of its own (anonymous: it vanishes
// with the kiln process). In it, on loopback, live two addresses of
// Options.Network (default 10.201.0.0/16):
//
//	.1  DNS responder (udp+tcp 53) and HTTP proxy (ProxyPort, 3128) — HTTP(S)_PROXY
//	.2  transparent listeners, one per port some attached policy allows
//
// Attach wires one box to it with a veth pair: the gateway's end (kbN) stays
// in the gateway namespace, the box's end is created directly in the box's
// namespace as eth0 with a /32 address (.3 upward) and on-link routes to .1
// and .2, default via .1. Inside the box an nftables table (kiln_egress)
// DNATs TCP to any allowed port on any address to .2 on the same port,
// accepts DNS and proxy traffic to .1, resets other TCP and rejects
// everything else (other UDP, ICMP, IPv6) so clients fail at once.
//
// The gateway reads the destination name from the TLS ClientHello (SNI) or
// the HTTP Host, checks it against the box's Policy, resolves it on the host
// (Options.Hosts/HostsFile first, then the host's DNS), refuses addresses in
// blockedRanges and the host's own addresses, and dials the checked address
// itself from the host namespace. What the box resolved or dialed is never
// used, so /etc/hosts inside the box and DNS rebinding change nothing.
//
// The name checked is the name the destination sees. Plain HTTP, whether
// transparent, inside a CONNECT tunnel or through HTTP_PROXY, is served
// by one HTTP server in the gateway that checks every request on a
// connection by its own Host (a tunnel's must be the CONNECT's name) and
// sends it with that Host, so a second request cannot front for another
// name on the first one's connection. TLS in a CONNECT tunnel must name
// the CONNECT's host in its SNI (or none). Inside TLS the gateway sees
// nothing: a client that sends SNI a.example and then Host: b.example
// reaches only a.example's address, and what that server does with the
// Host is its own affair. A tunnel carries only TLS or HTTP, as the
// transparent ports do.
//
// # Limits
//
// One box must not starve the server or other boxes. Each connection a
// box opens to the gateway takes a slot: Options.MaxConnsPerBox per box
// and Options.MaxConns in all, where a box under its fair share is still
// admitted at the global cap and the box holding the most loses its least
// recently used connection. A refused connection gets an answer (HTTP
// 503, or a TLS alert) and is closed. Connections close after
// Options.ConnIdleTimeout without a byte either way and after
// Options.ConnMaxLifetime in all; a refused request closes its
// connection. Names longer than 253 bytes are refused before they are
// logged; each box logs at most logBurst refusals per logWindow, and as
// many allowed attempts on a budget of their own, and one line counts the
// rest.
//
// # Why one gateway namespace and /32s
//
// Nothing is added to the host's namespace: no addresses, routes or
// firewall rules, so kiln cannot collide with the host's networks or other
// software, and the pool need not be free on the host. The gateway
// namespace has forwarding off, a firewall (kiln_gateway) that admits only
// the listeners and sends only replies, and strict reverse-path filtering,
// so a box that removed its own rules (it would need CAP_NET_ADMIN in its
// namespace) still reaches nothing but the gateway's listeners, and cannot
// pass for another box: the gateway knows a box by its source address. One
// /32 per box from a /16 serves 65,532 boxes at once with one set of
// listeners; boxes never share a link, so they cannot reach each other.
package egress
