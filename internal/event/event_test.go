package event

import "testing"

type count struct{ n int }

func (c *count) Observe(Event) { c.n++ }

func TestMulti(t *testing.T) {
	if Multi() != nil || Multi(nil, nil) != nil {
		t.Error("Multi of no observers is not nil")
	}
	Emit(nil, Exec{}) // no observer: dropped, no panic
	a, b := &count{}, &count{}
	if Multi(nil, a) != Observer(a) {
		t.Error("Multi of one observer is not that observer")
	}
	Emit(Multi(a, nil, b), Session{})
	if a.n != 1 || b.n != 1 {
		t.Errorf("Multi delivered %d and %d events, want 1 each", a.n, b.n)
	}
	for _, c := range []struct {
		e    Event
		want string
	}{{Exec{}, "exec"}, {Egress{}, "egress"}, {Session{}, "session"}, {Box{}, "box"}} {
		if Kind(c.e) != c.want {
			t.Errorf("Kind(%T) = %q, want %q", c.e, Kind(c.e), c.want)
		}
	}
}
