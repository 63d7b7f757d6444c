package egress

import (
	"bytes"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/miekg/dns"
)

// fakeDNSWriter is the ResponseWriter of a query from a box at remote.
type fakeDNSWriter struct {
	remote net.Addr
	got    *dns.Msg
}

func (w *fakeDNSWriter) LocalAddr() net.Addr {
	return &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 53}
}
func (w *fakeDNSWriter) RemoteAddr() net.Addr      { return w.remote }
func (w *fakeDNSWriter) WriteMsg(m *dns.Msg) error { w.got = m; return nil }
func (w *fakeDNSWriter) Write(b []byte) (int, error) {
	return len(b), nil
}
func (w *fakeDNSWriter) Close() error        { return nil }
func (w *fakeDNSWriter) TsigStatus() error   { return nil }
func (w *fakeDNSWriter) TsigTimersOnly(bool) {}
func (w *fakeDNSWriter) Hijack()             {}

// TestAllowedLogBounded: a box that looks an allowed name up in a loop
// cannot flood kiln's log either. Refusals were bounded (logBurst per
// logWindow); allowed attempts were one Info line each.
func TestAllowedLogBounded(t *testing.T) {
	var logs bytes.Buffer
	web := netip.MustParseAddr("192.0.2.7")
	c, err := newCore(Options{
		Logger:               slog.New(slog.NewTextHandler(&logs, nil)),
		Hosts:                map[string][]netip.Addr{"web.test": {web}},
		TestOnlyAllowedAddrs: []netip.Prefix{netip.PrefixFrom(web, 32)},
	})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := ParsePolicy("web.test")
	if err != nil {
		t.Fatal(err)
	}
	box := netip.MustParseAddr("10.0.0.2")
	a := c.newAttachment(BoxInfo{Session: "flooder", Policy: pol}, box)
	c.boxes[box] = a
	const queries = 1000
	for range queries {
		req := new(dns.Msg)
		req.SetQuestion("web.test.", dns.TypeA)
		w := &fakeDNSWriter{remote: &net.UDPAddr{IP: box.AsSlice(), Port: 5353}}
		c.serveDNS(w, req)
		if w.got == nil || len(w.got.Answer) != 1 {
			t.Fatalf("the allowed name was not answered: %v", w.got)
		}
	}
	a.Close()
	lines := strings.Count(logs.String(), "\n")
	if allowed := strings.Count(logs.String(), `msg="egress allowed"`); allowed > logBurst || lines > logBurst+2 {
		t.Errorf("%d lookups of an allowed name logged %d lines, %d of them \"egress allowed\"; want at most %d and a summary", queries, lines, allowed, logBurst)
	}
	if !strings.Contains(logs.String(), "not logged") {
		t.Errorf("the lines not logged are not counted:\n%s", logs.String())
	}
}
