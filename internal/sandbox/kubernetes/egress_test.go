package kubernetes

import (
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	netv1 "k8s.io/api/networking/v1"
)

// TestPodNetwork: a box without a network has a resolver that answers
// nothing and no proxy; a networked box's one resolver and proxy are its
// gateway, and its label names the gateway the egress policy lets it
// reach.
func TestPodNetwork(t *testing.T) {
	env := func(p *corev1.Pod) []string {
		var out []string
		for _, e := range p.Spec.Containers[0].Env {
			out = append(out, e.Name+"="+e.Value)
		}
		return out
	}
	bare := testPod(t, nil)
	if got := bare.Spec.DNSConfig.Nameservers; !slices.Equal(got, []string{"127.0.0.1"}) {
		t.Errorf("without a network, nameservers %v", got)
	}
	if _, ok := bare.Labels[LabelEgress]; ok {
		t.Error("a box without a network has the egress label")
	}
	for _, e := range env(bare) {
		if len(e) > 6 && (e[:6] == "HTTPS_" || e[:6] == "https_") {
			t.Errorf("without a network, %s", e)
		}
	}
	gw := netip.MustParseAddr("10.89.0.1")
	p := testPod(t, func(c *podConfig) {
		c.Net = &podNet{Gateway: gw, ProxyPort: 3128, Env: []string{"HTTPS_PROXY=http://10.89.0.1:3128"}}
	})
	if p.Spec.DNSPolicy != corev1.DNSNone || !slices.Equal(p.Spec.DNSConfig.Nameservers, []string{"10.89.0.1"}) {
		t.Errorf("networked box: dnsPolicy %s, nameservers %v", p.Spec.DNSPolicy, p.Spec.DNSConfig.Nameservers)
	}
	if !slices.Contains(env(p), "HTTPS_PROXY=http://10.89.0.1:3128") {
		t.Errorf("networked box's env lacks its proxy: %v", env(p))
	}
	if p.Labels[LabelEgress] != "10.89.0.1" {
		t.Errorf("egress label %q", p.Labels[LabelEgress])
	}
	np := EgressPolicy("ns", gw, 3128)
	if sel := np.Spec.PodSelector.MatchLabels; sel[LabelEgress] != "10.89.0.1" || sel[LabelComponent] != "box" {
		t.Errorf("the egress policy selects %v", sel)
	}
	if len(np.Spec.Egress) != 1 || len(np.Spec.Egress[0].To) != 1 || np.Spec.Egress[0].To[0].IPBlock.CIDR != "10.89.0.1/32" || len(np.Spec.Egress[0].Ports) != 3 {
		t.Errorf("the egress policy's rules: %+v", np.Spec.Egress)
	}
	if len(np.Spec.Ingress) != 0 || !slices.Equal(np.Spec.PolicyTypes, []netv1.PolicyType{netv1.PolicyTypeEgress}) {
		t.Errorf("the egress policy's types %v", np.Spec.PolicyTypes)
	}
}
