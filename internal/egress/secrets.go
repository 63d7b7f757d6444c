package egress

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"kiln/internal/config"
)

// Secrets at the egress: an operator names a credential for one host, and
// the box sees only a placeholder for it. The gateway terminates the box's
// TLS to that host with a certificate from a CA of its own (made when the
// gateway starts, its key only in the server's memory, trusted by the box
// through TrustBundle), puts the real value in place of the placeholder in
// the request's headers, and sends the request on over TLS it checks
// against the host's real certificate. Nothing else is intercepted: TLS to
// every other host is relayed as before, end to end.
//
// The value never enters the box: it is not in the box's environment or
// files, only the placeholder is; it goes out only in headers of HTTPS
// requests whose Host is the secret's host (a redirect elsewhere, or the
// same placeholder sent to another host, carries the placeholder); and
// it is replaced by the placeholder in what the host answers (headers and
// body), so a server that echoes a header cannot hand it back. Plain HTTP
// never gets it: it would cross the network in the clear. The gateway
// logs names, ports and verdicts, never headers.
//
// Only headers are rewritten: URLs land in error messages and logs, and
// bodies can be anything. A file secret is read at every request, so
// rotating the file rotates the secret without a restart; an environment
// secret is read once, when the gateway starts.

// Secret is one credential the gateway adds to a box's requests to Host.
type Secret struct {
	// Name is what the box sees: an environment variable of that name
	// holds the placeholder. Upper case letters, digits and _.
	Name string
	// Host is the one host name whose HTTPS requests get the value.
	Host string
	// Env is kiln's own environment variable that holds the value, or
	// File the file that holds it (trailing line breaks dropped).
	Env, File string

	value []byte // from Env, read by check
}

var secretName = regexp.MustCompile(`^[A-Z][A-Z0-9_]{0,63}$`)

// ParseSecret reads NAME@HOST=env:VAR or NAME@HOST=file:PATH, the form of
// kiln's --egress-secret flag and secret config entries.
func ParseSecret(spec string) (Secret, error) {
	lhs, src, ok := strings.Cut(spec, "=")
	name, host, ok2 := strings.Cut(lhs, "@")
	if !ok || !ok2 {
		return Secret{}, fmt.Errorf("egress secret %q: want NAME@HOST=env:VAR or NAME@HOST=file:PATH", clip(spec, 80))
	}
	s := Secret{Name: name, Host: normalizeName(host)}
	switch kind, v, _ := strings.Cut(src, ":"); kind {
	case "env":
		s.Env = v
	case "file":
		s.File = v
	default:
		return Secret{}, fmt.Errorf("egress secret %s: the value's source must be env:VAR or file:PATH, not %q", name, clip(src, 80))
	}
	return s, s.check()
}

func (s *Secret) check() error {
	if !secretName.MatchString(s.Name) {
		return fmt.Errorf("egress secret %q: the name must be upper case letters, digits and _, starting with a letter", clip(s.Name, 80))
	}
	if err := checkHostName(s.Host); err != nil || strings.HasPrefix(s.Host, "*.") {
		return fmt.Errorf("egress secret %s: %q is not one host name", s.Name, clip(s.Host, maxNameLen))
	}
	switch {
	case s.Env != "" && s.File != "":
		return fmt.Errorf("egress secret %s: give env or file, not both", s.Name)
	case s.Env != "":
		v, ok := os.LookupEnv(s.Env)
		if !ok || v == "" {
			return fmt.Errorf("egress secret %s: environment variable %s is not set", s.Name, s.Env)
		}
		s.value = []byte(v)
	case s.File != "":
		if _, err := s.read(); err != nil {
			return err
		}
	default:
		return fmt.Errorf("egress secret %s: no source (env or file)", s.Name)
	}
	return nil
}

// Placeholder is what the box holds in the secret's place.
func (s *Secret) Placeholder() string { return "kiln-secret-placeholder-" + s.Name }

// read returns the current value.
func (s *Secret) read() ([]byte, error) {
	if s.File == "" {
		return s.value, nil
	}
	// Checked at every read, as kiln's other secret files are checked
	// once: owned by root or kiln's user and private to its owner.
	f, err := config.OpenTrusted("egress secret file of "+s.Name, s.File, true)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 8<<10+1))
	if err != nil {
		return nil, fmt.Errorf("egress secret %s: reading its file: %w", s.Name, err)
	}
	b = bytes.TrimRight(b, "\r\n")
	switch {
	case len(b) == 0:
		return nil, fmt.Errorf("egress secret %s: its file is empty", s.Name)
	case len(b) > 8<<10:
		return nil, fmt.Errorf("egress secret %s: its file holds more than 8 KiB", s.Name)
	case bytes.ContainsAny(b, "\r\n\x00"):
		return nil, fmt.Errorf("egress secret %s: the value holds a line break or NUL, which a header cannot carry", s.Name)
	}
	return b, nil
}

// secrets is the gateway's side of its secrets: the CA the boxes trust and
// the certificates it makes for the secrets' hosts.
type secrets struct {
	list   []Secret
	key    *ecdsa.PrivateKey
	ca     *x509.Certificate
	caPEM  []byte
	mu     sync.Mutex
	leaves map[string]*tls.Certificate
}

func newSecrets(list []Secret) (*secrets, error) {
	if len(list) == 0 {
		return nil, nil
	}
	seen := map[string]bool{}
	for i := range list {
		if err := list[i].check(); err != nil {
			return nil, err
		}
		if seen[list[i].Name] {
			return nil, fmt.Errorf("egress secret %s: named twice", list[i].Name)
		}
		seen[list[i].Name] = true
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "kiln egress gateway CA (this server only)"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(1, 0, 0),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign,
		// Only the secrets' hosts: a box that trusts this CA trusts it
		// for nothing else, whatever the server signs.
		PermittedDNSDomainsCritical: true,
	}
	for _, s := range list {
		tmpl.PermittedDNSDomains = append(tmpl.PermittedDNSDomains, s.Host)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("making the egress CA: %w", err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &secrets{list: list, key: key, ca: ca, caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), leaves: map[string]*tls.Certificate{}}, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

// forHost is the secrets of host, nil when it has none.
func (s *secrets) forHost(host string) []*Secret {
	if s == nil {
		return nil
	}
	var out []*Secret
	for i := range s.list {
		if s.list[i].Host == host {
			out = append(out, &s.list[i])
		}
	}
	return out
}

// leaf is the certificate the gateway shows a box for host.
func (s *secrets) leaf(host string) (*tls.Certificate, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c, ok := s.leaves[host]; ok && time.Until(c.Leaf.NotAfter) > 24*time.Hour {
		return c, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: host},
		DNSNames:     []string{host},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.AddDate(0, 0, 30),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, s.ca, &key.PublicKey, s.key)
	if err != nil {
		return nil, err
	}
	leaf, _ := x509.ParseCertificate(der)
	c := &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
	s.leaves[host] = c
	return c, nil
}

// hostRoots are the system's CA bundles, first found wins, for
// TrustBundle (the box's bundle is the host's plus the gateway's CA).
var hostRoots = []string{"/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"}

// TrustBundle is the CA bundle a box with secrets must trust: the host's
// roots and the gateway's CA, in PEM. Empty when none of the box's allowed
// hosts has a secret: such a box trusts only the host's roots.
func (a *Attachment) TrustBundle() []byte {
	if !a.hasSecrets {
		return nil
	}
	return a.core.trustBundle()
}

// trustBundle is the host's roots and the gateway's CA, in PEM, as the
// gateway read them when the first box needed them.
func (c *core) trustBundle() []byte { return slices.Clone(c.bundle()) }

func (c *core) readTrustBundle() []byte {
	var b []byte
	for _, p := range hostRoots {
		if host, err := os.ReadFile(p); err == nil {
			b = append(host, '\n')
			break
		}
	}
	return append(b, c.sec.caPEM...)
}

// TrustEnv points the usual TLS clients at a TrustBundle installed at
// path inside the box.
func TrustEnv(path string) []string {
	return []string{"SSL_CERT_FILE=" + path, "REQUESTS_CA_BUNDLE=" + path, "CURL_CA_BUNDLE=" + path, "PIP_CERT=" + path, "NODE_EXTRA_CA_CERTS=" + path}
}

// envFor is the placeholders a box with policy p sees: one for each
// secret whose host p allows.
func (s *secrets) envFor(p Policy) []string {
	if s == nil {
		return nil
	}
	var env []string
	for i := range s.list {
		if p.AllowsName(s.list[i].Host) {
			env = append(env, s.list[i].Name+"="+s.list[i].Placeholder())
		}
	}
	return env
}

// substitute puts each secret's value in place of its placeholder in h:
// the values sc read, so that what goes out is what the answer is
// scrubbed of, even if a secret's file changes meanwhile.
func (sc *scrubber) substitute(h http.Header) {
	for _, p := range sc.pairs {
		value, ph := string(p[0]), string(p[1])
		for k, vals := range h {
			for i, val := range vals {
				h[k][i] = strings.ReplaceAll(val, ph, value)
			}
		}
	}
}

// scrubber replaces each secret's current value with its placeholder in
// what a secret's host answers.
type scrubber struct {
	pairs [][2][]byte // value, placeholder
	long  int         // the longest value
}

func newScrubber(list []*Secret) (*scrubber, error) {
	sc := &scrubber{}
	for _, s := range list {
		v, err := s.read()
		if err != nil {
			return nil, err
		}
		sc.pairs = append(sc.pairs, [2][]byte{v, []byte(s.Placeholder())})
		sc.long = max(sc.long, len(v))
	}
	return sc, nil
}

func (sc *scrubber) bytes(b []byte) []byte {
	for _, p := range sc.pairs {
		b = bytes.ReplaceAll(b, p[0], p[1])
	}
	return b
}

func (sc *scrubber) header(h http.Header) {
	for k, vals := range h {
		for i, v := range vals {
			h[k][i] = string(sc.bytes([]byte(v)))
		}
	}
}

// scrubReader is a body with every value replaced as it streams: it keeps
// back the last long-1 bytes until it knows they do not start a value.
type scrubReader struct {
	sc   *scrubber
	r    io.ReadCloser
	buf  []byte // scrubbed, ready
	tail []byte // raw, held back
	eof  bool
}

func (s *scrubReader) Read(p []byte) (int, error) {
	for len(s.buf) == 0 {
		if s.eof {
			return 0, io.EOF
		}
		chunk := make([]byte, 32<<10)
		n, err := s.r.Read(chunk)
		data := append(s.tail, chunk[:n]...)
		s.tail = nil
		switch {
		case errors.Is(err, io.EOF):
			s.eof = true
		case err != nil:
			return 0, err
		}
		data = s.sc.bytes(data)
		if keep := s.sc.long - 1; !s.eof && keep > 0 && len(data) > 0 {
			keep = min(keep, len(data))
			s.tail = bytes.Clone(data[len(data)-keep:])
			data = data[:len(data)-keep]
		}
		s.buf = data
	}
	n := copy(p, s.buf)
	s.buf = s.buf[n:]
	return n, nil
}

func (s *scrubReader) Close() error { return s.r.Close() }

// intercepts says whether the gateway terminates a box's TLS to name:port:
// only when name has a secret and the box may reach it.
func (c *core) intercepts(a *Attachment, name string, port uint16) bool {
	return a.hasSecrets && len(c.sec.forHost(normalizeName(name))) > 0 && a.Policy().Allows(normalizeName(name), port) && !a.cut.Load()
}

// tlsHTTPConn is a box's TLS connection to a secret's host, terminated by
// the gateway and handed to its HTTP server.
type tlsHTTPConn struct {
	*tls.Conn
	info connInfo
}

// intercept terminates the box's TLS to name (r reads what the box sent,
// its ClientHello first) and serves its requests as HTTPS to name.
func (c *core) intercept(conn *boxConn, r io.Reader, via, name string, port uint16) {
	name = normalizeName(name)
	cert, err := c.sec.leaf(name)
	if err != nil {
		c.log.Error("egress: making a certificate", "name", name, "err", err)
		refuseStream(conn, true, http403, "")
		conn.Close()
		return
	}
	tc := tls.Server(&httpConn{boxConn: conn, r: r}, &tls.Config{
		Certificates: []tls.Certificate{*cert},
		NextProtos:   []string{"http/1.1"},
		MinVersion:   tls.VersionTLS12,
	})
	c.http.push(&tlsHTTPConn{Conn: tc, info: connInfo{via: via, port: port, name: name, tls: true}})
}

type scrubKey struct{}

// withSecrets puts the secrets of host into r's headers and returns the
// context that tells scrubResponse to take them out of the answer.
func (c *core) withSecrets(ctx context.Context, r *http.Request, host string) (context.Context, error) {
	list := c.sec.forHost(host)
	if len(list) == 0 {
		return ctx, nil
	}
	sc, err := newScrubber(list)
	if err != nil {
		c.log.Error("egress secret unreadable", "name", host, "err", err)
		return ctx, errors.New("a secret for " + host + " cannot be read; the operator must fix it")
	}
	sc.substitute(r.Header)
	// An answer the gateway can read: a compressed body would carry an
	// echoed value past the scrubber.
	r.Header.Del("Accept-Encoding")
	return context.WithValue(ctx, scrubKey{}, sc), nil
}

// scrubResponse takes the secrets' values out of an answer from a
// secret's host (the ReverseProxy's ModifyResponse).
func scrubResponse(resp *http.Response) error {
	sc, _ := resp.Request.Context().Value(scrubKey{}).(*scrubber)
	if sc == nil {
		return nil
	}
	if ce := resp.Header.Get("Content-Encoding"); ce != "" && !strings.EqualFold(ce, "identity") {
		return fmt.Errorf("the answer is %s-encoded, which the gateway cannot check for secrets", clip(ce, 32))
	}
	sc.header(resp.Header)
	resp.Trailer = nil
	resp.Header.Del("Content-Length")
	resp.ContentLength = -1
	resp.Body = &scrubReader{sc: sc, r: resp.Body}
	return nil
}
