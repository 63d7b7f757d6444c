package egress

import (
	"errors"
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParsePolicy(t *testing.T) {
	tests := []struct {
		in      []string
		entries []string
	}{
		{nil, nil},
		{[]string{"PyPI.org."}, []string{"pypi.org"}},
		{[]string{"pypi.org, *.pythonhosted.org"}, []string{"pypi.org", "*.pythonhosted.org"}},
		{[]string{"example.com:8443", "example.com"}, []string{"example.com", "example.com:8443"}},
		{[]string{"example.com:80"}, []string{"example.com:80"}},
		{[]string{"a.test", "a.test:443", "a.test:80"}, []string{"a.test"}},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.in), func(t *testing.T) {
			p, err := ParsePolicy(tt.in...)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.entries, p.Entries()); diff != "" {
				t.Errorf("entries (-want +got):\n%s", diff)
			}
			again := MustParsePolicy(p.Entries()...)
			if !again.Equal(p) {
				t.Errorf("reparsed %v != %v", again, p)
			}
		})
	}
}

func TestParsePolicyRejects(t *testing.T) {
	for _, in := range []string{
		"*", "*.", "1.2.3.4", "1.2.3.4:80", "[::1]:443", "::1", "exa mple.com", "a..b", "*.*.com",
		"foo.*.com", "host:0", "host:65536", "host:http", "-", "a/b", "ex%61mple.com",
	} {
		if _, err := ParsePolicy(in); !errors.Is(err, ErrInvalidPolicy) {
			t.Errorf("ParsePolicy(%q) = %v, want ErrInvalidPolicy", in, err)
		}
	}
}

func TestPolicyAllows(t *testing.T) {
	p := MustParsePolicy("pypi.org", "*.pythonhosted.org", "api.test:8443")
	tests := []struct {
		name string
		port uint16
		want bool
	}{
		{"pypi.org", 443, true},
		{"PYPI.ORG.", 80, true},
		{"pypi.org", 8443, false},
		{"www.pypi.org", 443, false},
		{"files.pythonhosted.org", 443, true},
		{"a.b.pythonhosted.org", 80, true},
		{"pythonhosted.org", 443, false}, // a wildcard does not match its apex
		{"evilpythonhosted.org", 443, false},
		{"pythonhosted.org.evil.com", 443, false},
		{"api.test", 8443, true},
		{"api.test", 443, false},
		{"", 443, false},
	}
	for _, tt := range tests {
		if got := p.Allows(tt.name, tt.port); got != tt.want {
			t.Errorf("Allows(%q, %d) = %v, want %v", tt.name, tt.port, got, tt.want)
		}
	}
	if !p.AllowsName("api.test") || p.AllowsName("pythonhosted.org") {
		t.Error("AllowsName wrong")
	}
	if diff := cmp.Diff([]uint16{80, 443, 8443}, p.Ports()); diff != "" {
		t.Error(diff)
	}
}

func TestEmptyPolicy(t *testing.T) {
	var p Policy
	if !p.Empty() || p.Allows("example.com", 443) || p.AllowsName("example.com") || len(p.Ports()) != 0 {
		t.Error("zero Policy allows something")
	}
	if p.String() != "none (loopback only)" {
		t.Errorf("String() = %q", p.String())
	}
	if !MustParsePolicy("a.test").Narrow(p).Empty() || !p.Narrow(MustParsePolicy("a.test")).Empty() {
		t.Error("narrowing with an empty policy is not empty")
	}
}

func TestNarrow(t *testing.T) {
	server := MustParsePolicy("pypi.org", "*.pythonhosted.org", "*.example.com:8443", "github.com:443")
	tests := []struct {
		session []string
		want    []string
	}{
		{[]string{"pypi.org"}, []string{"pypi.org"}},
		{[]string{"evil.com"}, nil},
		{[]string{"*.org"}, []string{"pypi.org", "*.pythonhosted.org"}}, // cannot widen past the server
		{[]string{"files.pythonhosted.org"}, []string{"files.pythonhosted.org"}},
		{[]string{"*.a.pythonhosted.org"}, []string{"*.a.pythonhosted.org"}},
		{[]string{"pythonhosted.org"}, nil},
		{[]string{"github.com"}, []string{"github.com:443"}}, // only the ports both allow
		{[]string{"github.com:22"}, nil},
		{[]string{"x.example.com:8443", "x.example.com"}, []string{"x.example.com:8443"}},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.session), func(t *testing.T) {
			got := server.Narrow(MustParsePolicy(tt.session...))
			if diff := cmp.Diff(tt.want, got.Entries()); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

// TestNarrowIsIntersection checks Narrow against its definition on a grid
// of names and ports: allowed by the result iff allowed by both.
func TestNarrowIsIntersection(t *testing.T) {
	policies := [][]string{
		nil, {"a.test"}, {"*.a.test"}, {"*.test"}, {"b.a.test:8080"}, {"*.b.a.test", "c.test:443"},
		{"a.test:80"}, {"*.a.test:443", "a.test"},
	}
	names := []string{"a.test", "b.a.test", "c.b.a.test", "c.test", "test", "x.test", "a.testx"}
	ports := []uint16{80, 443, 8080}
	for _, pe := range policies {
		for _, qe := range policies {
			p, q := MustParsePolicy(pe...), MustParsePolicy(qe...)
			n := p.Narrow(q)
			for _, name := range names {
				for _, port := range ports {
					want := p.Allows(name, port) && q.Allows(name, port)
					if got := n.Allows(name, port); got != want {
						t.Errorf("%v.Narrow(%v) = %v: Allows(%s, %d) = %v, want %v", p, q, n, name, port, got, want)
					}
				}
			}
		}
	}
}

func TestDescribe(t *testing.T) {
	if got := Describe(Policy{}); got != "The sandbox has no network access (loopback only)." {
		t.Error(got)
	}
	got := Describe(MustParsePolicy("pypi.org"))
	if want := "The sandbox can reach only these hosts over HTTP(S) (ports 80 and 443 unless a port is given): pypi.org. Everything else, including raw IP connections, other UDP and ICMP, is refused."; got != want {
		t.Errorf("Describe = %q", got)
	}
}
