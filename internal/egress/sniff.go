package egress

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
)

// Limits on what the gateway reads from a box before it knows where the
// connection goes.
const (
	maxClientHello = 64 << 10 // bytes of handshake message
	maxHTTPHeader  = 64 << 10 // bytes of request line and headers (the proxy's HTTP server)
	sniffBuffer    = maxClientHello + 4<<10
)

var (
	errNotClientHello = errors.New("not a TLS ClientHello")
	errNoSNI          = errors.New("TLS ClientHello has no server name (SNI)")
	errTooLarge       = errors.New("too large")
)

// parseClientHello reads the server name from the start of a TLS stream,
// b. If b is too short it returns need > len(b), the length to read before
// calling again; otherwise need is 0 and name or err is set.
func parseClientHello(b []byte) (name string, need int, err error) {
	var hs []byte // handshake bytes gathered from the records so far
	off := 0
	for {
		if len(b) < off+5 {
			return "", off + 5, nil
		}
		if b[off] != 22 || b[off+1] != 3 { // handshake record, TLS 1.x
			return "", 0, errNotClientHello
		}
		n := int(binary.BigEndian.Uint16(b[off+3:]))
		if n == 0 || n > 1<<14 {
			return "", 0, fmt.Errorf("%w: TLS record length %d", errNotClientHello, n)
		}
		if len(b) < off+5+n {
			return "", off + 5 + n, nil
		}
		hs = append(hs, b[off+5:off+5+n]...)
		off += 5 + n
		if len(hs) < 4 {
			continue
		}
		if hs[0] != 1 {
			return "", 0, errNotClientHello
		}
		mlen := int(hs[1])<<16 | int(hs[2])<<8 | int(hs[3])
		if mlen > maxClientHello {
			return "", 0, fmt.Errorf("ClientHello: %w", errTooLarge)
		}
		if len(hs) >= 4+mlen {
			name, err := clientHelloServerName(hs[4 : 4+mlen])
			return name, 0, err
		}
	}
}

// clientHelloServerName parses a ClientHello body (RFC 8446 4.1.2) and
// returns its server_name extension's host name.
func clientHelloServerName(m []byte) (string, error) {
	s := cursor{b: m}
	s.skip(2 + 32)             // legacy_version, random
	s.skip(int(s.u8()))        // legacy_session_id
	s.skip(int(s.u16()))       // cipher_suites
	s.skip(int(s.u8()))        // legacy_compression_methods
	if s.bad || s.len() == 0 { // no extensions at all
		if s.bad {
			return "", errNotClientHello
		}
		return "", errNoSNI
	}
	exts := cursor{b: s.bytes(int(s.u16()))}
	if s.bad {
		return "", errNotClientHello
	}
	for exts.len() > 0 {
		typ, body := exts.u16(), exts.bytes(int(exts.u16()))
		if exts.bad {
			return "", errNotClientHello
		}
		if typ != 0 { // server_name
			continue
		}
		e := cursor{b: body}
		list := cursor{b: e.bytes(int(e.u16()))}
		for list.len() > 0 && !list.bad {
			kind, host := list.u8(), list.bytes(int(list.u16()))
			if kind == 0 && !list.bad { // host_name
				if len(host) == 0 || bytes.IndexFunc(host, func(r rune) bool { return r <= ' ' || r > '~' }) >= 0 {
					return "", fmt.Errorf("%w: malformed server name", errNotClientHello)
				}
				return string(host), nil
			}
		}
		return "", errNotClientHello
	}
	return "", errNoSNI
}

// cursor reads big-endian fields; after a short read bad is set and every
// later read returns zeros.
type cursor struct {
	b   []byte
	bad bool
}

func (c *cursor) len() int { return len(c.b) }

func (c *cursor) bytes(n int) []byte {
	if c.bad || n > len(c.b) {
		c.bad = true
		return nil
	}
	out := c.b[:n]
	c.b = c.b[n:]
	return out
}

func (c *cursor) skip(n int) { c.bytes(n) }

func (c *cursor) u8() uint8 {
	b := c.bytes(1)
	if b == nil {
		return 0
	}
	return b[0]
}

func (c *cursor) u16() uint16 {
	b := c.bytes(2)
	if b == nil {
		return 0
	}
	return binary.BigEndian.Uint16(b)
}

// sniffTLS returns the SNI of the ClientHello at the start of br without
// consuming it.
func sniffTLS(br *bufio.Reader) (string, error) {
	need := 5
	for {
		if need > br.Size() {
			return "", fmt.Errorf("ClientHello: %w", errTooLarge)
		}
		b, err := br.Peek(need)
		if err != nil {
			return "", fmt.Errorf("reading ClientHello: %w", err)
		}
		name, n, err := parseClientHello(b)
		if n == 0 {
			return name, err
		}
		need = n
	}
}
