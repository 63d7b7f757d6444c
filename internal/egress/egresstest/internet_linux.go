//go:build linux

// Package egresstest is the local internet kiln's egress tests reach
// through the gateway: a web host in a network namespace of the test's own,
// linked to the host's namespace by a veth, and an upstream DNS resolver
// there that counts the questions it is asked. No packet leaves the
// machine. It does not import egress, so the gateway's own tests use it
// as well as the backends' (sandboxtest's battery).
//
//	host netns (the test process, where the gateway dials from)
//	  └─ veth kw<id> 10.77.K.1/24 ── web netns: 10.77.K.2 (web.test, pypi.test, …: HTTP, HTTPS, UDP echo, DNS)
//	                                            10.77.K.3 (internal.test: HTTP, a private host)
package egresstest

import (
	"archive/zip"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"kiln/internal/netnsrun"
)

var seq atomic.Int32

// Internet is the local internet of one test.
type Internet struct {
	t        testing.TB
	ID       string     // unique per Internet in this machine's tests: a prefix for names
	WebAddr  netip.Addr // 10.77.K.2: the web host, the one address the gateway may dial
	IntAddr  netip.Addr // 10.77.K.3: a private host the gateway must refuse
	CAFile   string     // PEM of the web host's self-signed certificate (web.test, pypi.test, other.test, meta.test, api.test)
	WheelSHA string     // sha256 of the wheel pypi.test serves (kilnprobe 0.1)
	UDPEcho  netip.AddrPort
	UDPHits  atomic.Int32 // datagrams the UDP echo received
	Upstream *CountingResolver

	// HostsFile maps web.test, pypi.test, other.test and api.test to the
	// web host, in /etc/hosts format; Hosts maps names to addresses the
	// gateway must refuse after resolution (internal.test, meta.test,
	// loop.test, rebind.test). Both are for the gateway's options.
	HostsFile string
	Hosts     map[string][]netip.Addr

	echoMu sync.Mutex
	echoes []string // "host auth=… key=…" of each /echo request the web host served
}

// Need skips t unless this process can build the local internet: root,
// network namespaces, ip(8).
func Need(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to create network namespaces, veth pairs and nftables rules")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("skipping: ip not found (install iproute2)")
	}
	ns, err := netnsrun.New()
	if err != nil {
		t.Skipf("skipping: cannot create a network namespace: %v", err)
	}
	ns.Close()
	if err := exec.Command("ip", "netns", "list").Run(); err != nil {
		t.Skipf("skipping: ip netns does not work: %v", err)
	}
}

// New builds the local internet; it goes when the test ends.
func New(t testing.TB) *Internet {
	t.Helper()
	Need(t)
	n := seq.Add(1)
	k := 20 + (os.Getpid()+int(n))%200
	in := &Internet{
		t:       t,
		ID:      fmt.Sprintf("%d%d", os.Getpid()%10000, n),
		WebAddr: netip.AddrFrom4([4]byte{10, 77, byte(k), 2}),
		IntAddr: netip.AddrFrom4([4]byte{10, 77, byte(k), 3}),
	}
	webNS := NamedNS(t, "kt"+in.ID+"-web")
	hostIf := "kw" + in.ID
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostIf}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(webNS))}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("creating web veth: %v", err)
	}
	t.Cleanup(func() { netlink.LinkDel(veth) })
	hostAddr := netip.AddrFrom4([4]byte{10, 77, byte(k), 1})
	if err := netlink.AddrAdd(veth, &netlink.Addr{IPNet: &net.IPNet{IP: hostAddr.AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(veth); err != nil {
		t.Fatal(err)
	}
	h, err := netlink.NewHandleAt(webNS)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	for _, name := range []string{"lo", "eth0"} {
		l, err := h.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if name == "eth0" {
			for _, a := range []netip.Addr{in.WebAddr, in.IntAddr} {
				if err := h.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := h.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	in.serve(webNS)

	in.HostsFile = filepath.Join(t.TempDir(), "hosts")
	os.WriteFile(in.HostsFile, []byte(fmt.Sprintf("# the gateway's view\n%s web.test pypi.test other.test api.test\n", in.WebAddr)), 0o644)
	in.Hosts = map[string][]netip.Addr{
		"internal.test": {in.IntAddr},
		"meta.test":     {netip.MustParseAddr("169.254.169.254")},
		"loop.test":     {netip.MustParseAddr("127.0.0.1")},
		"rebind.test":   {netip.MustParseAddr("169.254.169.254"), netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("::1")},
	}
	return in
}

// NamedNS creates a named network namespace (ip netns add), removed when
// the test ends.
func NamedNS(t testing.TB, name string) netns.NsHandle {
	t.Helper()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v\n%s", name, err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	ns, err := netns.GetFromName(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	return ns
}

// Allowed is the prefix the gateway may dial in these tests (its
// TestOnlyAllowedAddrs): the web host alone, so the private host stays
// refused like any other internal address.
func (in *Internet) Allowed() []netip.Prefix {
	return []netip.Prefix{netip.PrefixFrom(in.WebAddr, 32)}
}

// Roots holds the web host's certificate, for TLS the gateway makes
// itself (a secret's host).
func (in *Internet) Roots() *x509.CertPool {
	pool := x509.NewCertPool()
	b, err := os.ReadFile(in.CAFile)
	if err != nil || !pool.AppendCertsFromPEM(b) {
		in.t.Fatalf("reading the web host's CA: %v", err)
	}
	return pool
}

// Served is what the web host's /echo saw since the last call.
func (in *Internet) Served() []string {
	in.echoMu.Lock()
	defer in.echoMu.Unlock()
	got := in.echoes
	in.echoes = nil
	return got
}

// serve starts the web host's servers inside webNS: HTTP and HTTPS on the
// web address (web.test answers "web:<host><path>", /echo reports the
// credentials it got, /redirect?to= redirects, pypi.test is a package
// index with one wheel), HTTP on the private address ("internal"), a UDP
// echo on 5353 and the upstream resolver on 53.
func (in *Internet) serve(webNS netns.NsHandle) {
	t := in.t
	cert := in.selfSigned("web.test", "pypi.test", "other.test", "meta.test", "api.test")
	wheelName, wheel := Wheel(t)
	sum := sha256.Sum256(wheel)
	in.WheelSHA = hex.EncodeToString(sum[:])
	mux := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		host, _, err := net.SplitHostPort(r.Host)
		if err != nil {
			host = r.Host
		}
		switch {
		case r.URL.Path == "/echo":
			// What a server with a secret's host name received, and the
			// echo of it that a hostile server might send back.
			got := fmt.Sprintf("%s auth=%s key=%s", host, r.Header.Get("Authorization"), r.Header.Get("X-Api-Key"))
			in.echoMu.Lock()
			in.echoes = append(in.echoes, got)
			in.echoMu.Unlock()
			rw.Header().Set("X-Echo", got)
			fmt.Fprintf(rw, "echo %s\n", got)
		case r.URL.Path == "/redirect":
			http.Redirect(rw, r, r.URL.Query().Get("to"), http.StatusFound)
		case host == "pypi.test" && r.URL.Path == "/simple/kilnprobe/":
			fmt.Fprintf(rw, "<!DOCTYPE html><html><body><a href=\"/packages/%s#sha256=%s\">%s</a></body></html>\n", wheelName, in.WheelSHA, wheelName)
		case host == "pypi.test" && r.URL.Path == "/packages/"+wheelName:
			rw.Header().Set("Content-Type", "application/octet-stream")
			rw.Write(wheel)
		case host == "pypi.test":
			http.NotFound(rw, r)
		default:
			fmt.Fprintf(rw, "web:%s%s", host, r.URL.Path)
		}
	})
	internal := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) { fmt.Fprint(rw, "internal") })

	var lns []net.Listener
	var udp net.PacketConn
	err := netnsrun.In(webNS, func() error {
		for _, addr := range []string{in.WebAddr.String() + ":80", in.WebAddr.String() + ":443", in.IntAddr.String() + ":80"} {
			ln, err := net.Listen("tcp4", addr)
			if err != nil {
				return err
			}
			lns = append(lns, ln)
		}
		var err error
		udp, err = net.ListenPacket("udp4", in.WebAddr.String()+":5353")
		return err
	})
	if err != nil {
		t.Fatalf("listening in web namespace: %v", err)
	}
	servers := []*http.Server{{Handler: mux}, {Handler: mux, TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}}}, {Handler: internal}}
	for i, srv := range servers {
		ln := lns[i]
		if i == 1 {
			ln = tls.NewListener(ln, srv.TLSConfig)
		}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
	}
	in.Upstream = newCountingResolver(t, webNS, in.WebAddr)
	in.UDPEcho = udp.LocalAddr().(*net.UDPAddr).AddrPort()
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := udp.ReadFrom(buf)
			if err != nil {
				return
			}
			in.UDPHits.Add(1)
			udp.WriteTo(buf[:n], from)
		}
	}()
	t.Cleanup(func() { udp.Close() })
}

func (in *Internet) selfSigned(names ...string) tls.Certificate {
	t := in.t
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: names[0]},
		DNSNames:              names,
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	in.CAFile = filepath.Join(t.TempDir(), "ca.pem")
	os.WriteFile(in.CAFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// Wheel makes a tiny pure-Python wheel, kilnprobe 0.1, whose module
// says VALUE = 'kiln-probe-ok', and returns its file name and bytes.
func Wheel(t testing.TB) (string, []byte) {
	files := []struct{ name, body string }{
		{"kilnprobe/__init__.py", "VALUE = 'kiln-probe-ok'\n"},
		{"kilnprobe-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: kilnprobe\nVersion: 0.1\n"},
		{"kilnprobe-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: kiln-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"},
	}
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	var record strings.Builder
	for _, f := range files {
		fw, err := zw.Create(f.name)
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(fw, f.body)
		sum := sha256.Sum256([]byte(f.body))
		fmt.Fprintf(&record, "%s,sha256=%s,%d\n", f.name, base64.RawURLEncoding.EncodeToString(sum[:]), len(f.body))
	}
	record.WriteString("kilnprobe-0.1.dist-info/RECORD,,\n")
	fw, _ := zw.Create("kilnprobe-0.1.dist-info/RECORD")
	io.WriteString(fw, record.String())
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return "kilnprobe-0.1-py3-none-any.whl", buf.Bytes()
}

// CountingResolver is the upstream DNS server of the local internet, in
// the web namespace on port 53 of the web host: it answers A queries for
// up.test and names under it with the web host's address, NXDOMAIN for
// the rest, and records every question it is asked, so a test can tell
// which names left the host.
type CountingResolver struct {
	Addr netip.AddrPort
	mu   sync.Mutex
	seen []string // "name TYPE", in arrival order
}

func newCountingResolver(t testing.TB, ns netns.NsHandle, addr netip.Addr) *CountingResolver {
	t.Helper()
	r := &CountingResolver{Addr: netip.AddrPortFrom(addr, 53)}
	var udp net.PacketConn
	var tcp net.Listener
	err := netnsrun.In(ns, func() error {
		var err error
		if udp, err = net.ListenPacket("udp4", r.Addr.String()); err != nil {
			return err
		}
		tcp, err = net.Listen("tcp4", r.Addr.String())
		return err
	})
	if err != nil {
		t.Fatalf("starting the upstream resolver: %v", err)
	}
	for _, srv := range []*dns.Server{{PacketConn: udp, Handler: r}, {Listener: tcp, Handler: r}} {
		go srv.ActivateAndServe()
		t.Cleanup(func() { srv.Shutdown() })
	}
	return r
}

func (r *CountingResolver) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	for _, q := range req.Question {
		name := strings.ToLower(strings.TrimSuffix(q.Name, "."))
		r.mu.Lock()
		r.seen = append(r.seen, name+" "+dns.TypeToString[q.Qtype])
		r.mu.Unlock()
		switch {
		case name != "up.test" && !strings.HasSuffix(name, ".up.test"):
			m.Rcode = dns.RcodeNameError
		case q.Qtype == dns.TypeA:
			m.Answer = append(m.Answer, &dns.A{
				Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60},
				A:   r.Addr.Addr().AsSlice(),
			})
		}
	}
	w.WriteMsg(m)
}

// Resolver is a Go resolver that asks only this server (the gateway's
// Options.Resolver), so the tests see every query that leaves the host.
func (r *CountingResolver) Resolver() *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, r.Addr.String())
	}}
}

// Questions is what the server has been asked so far.
func (r *CountingResolver) Questions() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen...)
}
