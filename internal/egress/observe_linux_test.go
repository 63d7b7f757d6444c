package egress

import (
	"sync"
	"testing"

	"github.com/miekg/dns"

	"kiln/internal/event"
)

type egressRecorder struct {
	mu  sync.Mutex
	got []event.Egress
}

func (r *egressRecorder) Observe(e event.Event) {
	if x, ok := e.(event.Egress); ok {
		r.mu.Lock()
		r.got = append(r.got, x)
		r.mu.Unlock()
	}
}

func (r *egressRecorder) has(box, via, name string, port uint16, verdict string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.got {
		if e.Box == box && e.Via == via && e.Name == name && e.Port == port && e.Verdict == verdict && !e.Time.IsZero() {
			return true
		}
	}
	return false
}

// TestObserveVerdicts: every attempt reaches the observer (the audit log
// and the metrics) with its box and verdict: allowed and refused
// connections, and DNS lookups of both kinds.
func TestObserveVerdicts(t *testing.T) {
	rec := &egressRecorder{}
	w := newWorld(t, func(o *Options) { o.Observer = rec })
	b := w.newBox(t, "s-obs", "web.test")

	wantPrefix(t, b.fetch(t, nil, "http://web.test/seen"), "OK 200 web:web.test/seen")
	out, _ := b.curl(t, nil, "--resolve", "other.test:80:"+w.WebAddr.String(), "http://other.test/")
	wantContains(t, out, "refused by policy")
	b.query(t, w.gw.GatewayAddr(), "udp", "web.test", dns.TypeA)
	b.query(t, w.gw.GatewayAddr(), "udp", "other.test", dns.TypeA)

	for _, c := range []struct {
		via, name string
		port      uint16
		verdict   string
	}{
		{"http", "web.test", 80, event.VerdictAllow},
		{"http", "other.test", 80, event.VerdictRefuse},
		{"dns", "web.test", 0, event.VerdictAllow},
		{"dns", "other.test", 0, event.VerdictRefuse},
	} {
		if !rec.has("s-obs", c.via, c.name, c.port, c.verdict) {
			t.Errorf("no %s event for %s %s:%d; got %+v", c.verdict, c.via, c.name, c.port, rec.got)
		}
	}
}
