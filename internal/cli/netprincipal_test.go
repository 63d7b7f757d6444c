package cli

import (
	"slices"
	"strings"
	"testing"

	"kiln/internal/egress"
)

func TestParsePrincipalNets(t *testing.T) {
	server := egress.MustParsePolicy("pypi.org", "*.pythonhosted.org", "github.com")
	nets, err := parsePrincipalNets(" ci = pypi.org, files.pythonhosted.org ; bot=; *=github.com", server)
	if err != nil {
		t.Fatal(err)
	}
	if got := nets.String(); got != "*=github.com; bot=none; ci=files.pythonhosted.org, pypi.org" {
		t.Errorf("String() = %q", got)
	}
	ci, ok := nets.lookup("ci")
	if !ok || !slices.Equal(ci.Hosts, []string{"files.pythonhosted.org", "pypi.org"}) || !strings.Contains(ci.Describe, "files.pythonhosted.org, pypi.org") {
		t.Errorf("lookup(ci) = %+v, %v", ci, ok)
	}
	if bot, ok := nets.lookup("bot"); !ok || len(bot.Hosts) != 0 || bot.Describe != "" {
		t.Errorf("lookup(bot) = %+v, %v: want no network", bot, ok)
	}
	if other, ok := nets.lookup("someone"); !ok || !slices.Equal(other.Hosts, []string{"github.com"}) {
		t.Errorf("lookup(someone) = %+v, %v: want *'s github.com", other, ok)
	}
	if nets, _ := parsePrincipalNets("ci=pypi.org", server); nets != nil {
		if _, ok := nets.lookup("dev"); ok {
			t.Error("without *, an unnamed principal got an allowlist of its own")
		}
	}

	for _, tt := range []struct{ spec, want string }{
		{"ci=pypi.org,evil.test", "allows only pypi.org of it"},
		{"ci=*.org", "allows only"},
		{"ci=pypi.org:8443", "allows none of it"},
		{"ci=pypi.org; ci=github.com", "ci is named twice"},
		{"pypi.org", "is not PRINCIPAL=HOSTS"},
		{"=pypi.org", "is not PRINCIPAL=HOSTS"},
		{"ci=not a host", "ci:"},
	} {
		if _, err := parsePrincipalNets(tt.spec, server); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("parsePrincipalNets(%q) = %v, want an error containing %q", tt.spec, err, tt.want)
		}
	}
	if _, err := parsePrincipalNets("ci=pypi.org", egress.Policy{}); err == nil || !strings.Contains(err.Error(), "set --allow-net") {
		t.Errorf("without --allow-net: %v", err)
	}
	if nets, err := parsePrincipalNets("  ", server); nets != nil || err != nil {
		t.Errorf("empty spec: %v %v", nets, err)
	}
}
