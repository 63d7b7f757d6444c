package kubernetes

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"

	corev1 "k8s.io/api/core/v1"
	netv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"kiln/internal/boxpolicy"
	"kiln/internal/egress"
	"kiln/internal/sandbox"
)

// A box with a policy reaches the network only through the egress gateway
// of kiln's replica, as on every other backend: the gateway listens on an
// address of the replica that the Pods reach (egress.Options.Listen,
// kiln's --egress-listen), a second NetworkPolicy lets the boxes labelled
// with that address reach its DNS and proxy ports and nothing else, and
// each box is given that address as its only resolver and its proxy. The
// gateway knows a box by its Pod IP, which the replica attaches once the
// Pod runs and detaches when the box goes (egress.Gateway.AttachAddr).
//
// A session adopted by another replica keeps its Pod's resolver and proxy,
// which are its first replica's; the adopter serves it only when the two
// share a gateway address, and otherwise refuses it (the session starts
// again in a new box) rather than leave its rules to a gateway it does not
// hold.

// LabelEgress is the gateway address a box's network leads to ("" or
// absent: no network); the egress NetworkPolicy selects by it.
const LabelEgress = "kiln.dev/egress"

// podNet is what a networked box's Pod is given: its gateway's address
// and the environment that points its programs at the proxy.
type podNet struct {
	Gateway   netip.Addr
	ProxyPort uint16
	Env       []string
	// Trust names the ConfigMap holding the gateway's CA bundle, mounted
	// at boxpolicy.TrustBundle; "" without secrets.
	Trust string
}

// egressOn reports whether the backend's boxes have a network.
func (o Options) egressOn() bool { return o.Egress != nil && !o.Policy.Empty() }

// checkEgress refuses an egress configuration the backend cannot honour.
func (o Options) checkEgress() error {
	if !o.egressOn() {
		return nil
	}
	if !o.Egress.Listening() {
		return errors.New("kubernetes: --allow-net needs --egress-listen ADDR, an address of this kiln that the box Pods reach (in a Pod: its own IP, from the downward API's status.podIP); the boxes' resolver and proxy are there")
	}
	return nil
}

// podNet is the network of the backend's boxes; nil without one.
func (b *Backend) podNet() *podNet {
	if !b.opts.egressOn() {
		return nil
	}
	g := b.opts.Egress
	setup := g.BoxSetup(b.opts.Policy)
	n := &podNet{Gateway: g.GatewayAddr(), ProxyPort: g.ProxyPort(), Env: setup.Env}
	if setup.TrustBundle != nil {
		n.Trust = trustName(setup.TrustBundle)
		n.Env = append(n.Env, egress.TrustEnv(boxpolicy.TrustBundle)...)
	}
	return n
}

// trustKey is the key of the CA bundle in its ConfigMap.
const trustKey = "ca.pem"

// trustName names the ConfigMap of a CA bundle by its content: the
// gateway's CA is its own, made at its start, so each gateway has one.
func trustName(bundle []byte) string {
	h := sha256.Sum256(bundle)
	return "kiln-egress-ca-" + hex.EncodeToString(h[:8])
}

// ensureTrust puts the gateway's CA bundle, which boxes whose policy allows
// a secret's host must trust (the gateway terminates their TLS to that
// host), in an immutable ConfigMap owned by this replica's Lease, so it
// goes with the replica. It holds certificates only: the CA's key never
// leaves the gateway.
func (b *Backend) ensureTrust(ctx context.Context, owner *metav1.OwnerReference) error {
	if !b.opts.egressOn() {
		return nil
	}
	bundle := b.opts.Egress.BoxSetup(b.opts.Policy).TrustBundle
	if bundle == nil {
		return nil
	}
	t := true
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: trustName(bundle), Namespace: b.opts.Namespace,
			Labels: map[string]string{LabelManagedBy: ManagedBy}, OwnerReferences: []metav1.OwnerReference{*owner}},
		Immutable: &t,
		Data:      map[string]string{trustKey: string(bundle)},
	}
	if _, err := b.cs.CoreV1().ConfigMaps(b.opts.Namespace).Create(ctx, cm, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("storing the egress gateway's CA bundle for the boxes: %w", err)
	}
	return nil
}

// trustVolume is the volume and mount of n's CA bundle; nil without one.
func trustVolume(n *podNet) (*corev1.Volume, *corev1.VolumeMount) {
	if n == nil || n.Trust == "" {
		return nil, nil
	}
	v := &corev1.Volume{Name: "egress-ca", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
		LocalObjectReference: corev1.LocalObjectReference{Name: n.Trust},
		Items:                []corev1.KeyToPath{{Key: trustKey, Path: trustKey}},
	}}}
	return v, &corev1.VolumeMount{Name: v.Name, MountPath: boxpolicy.TrustBundle, SubPath: trustKey, ReadOnly: true}
}

// egressPolicyName is the NetworkPolicy of the boxes whose gateway is at
// addr.
func egressPolicyName(addr netip.Addr) string {
	return "kiln-boxes-egress-" + strings.NewReplacer(".", "-", ":", "-").Replace(addr.String())
}

// EgressPolicy is the NetworkPolicy that lets kiln's boxes labelled with
// gateway addr reach that address's DNS (53, UDP and TCP) and HTTP proxy
// port, and nothing else; the default-deny policy (DenyAll) holds the rest.
func EgressPolicy(ns string, addr netip.Addr, proxyPort uint16) *netv1.NetworkPolicy {
	udp, tcp := corev1.ProtocolUDP, corev1.ProtocolTCP
	port := func(p *corev1.Protocol, n int) netv1.NetworkPolicyPort {
		v := intstr.FromInt32(int32(n))
		return netv1.NetworkPolicyPort{Protocol: p, Port: &v}
	}
	return &netv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: egressPolicyName(addr), Namespace: ns, Labels: map[string]string{LabelManagedBy: ManagedBy}},
		Spec: netv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{LabelManagedBy: ManagedBy, LabelComponent: "box", LabelEgress: addr.String()}},
			PolicyTypes: []netv1.PolicyType{netv1.PolicyTypeEgress},
			Egress: []netv1.NetworkPolicyEgressRule{{
				To:    []netv1.NetworkPolicyPeer{{IPBlock: &netv1.IPBlock{CIDR: netip.PrefixFrom(addr, addr.BitLen()).String()}}},
				Ports: []netv1.NetworkPolicyPort{port(&udp, 53), port(&tcp, 53), port(&tcp, int(proxyPort))},
			}},
		},
	}
}

// ensureEgressPolicy applies EgressPolicy for the backend's gateway, or
// brings an existing one up to date (another replica may share the
// address, and an older kiln may have written it).
func ensureEgressPolicy(ctx context.Context, b *Backend) error {
	n := b.podNet()
	want := EgressPolicy(b.opts.Namespace, n.Gateway, n.ProxyPort)
	api := b.cs.NetworkingV1().NetworkPolicies(b.opts.Namespace)
	_, err := api.Create(ctx, want, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		var cur *netv1.NetworkPolicy
		if cur, err = api.Get(ctx, want.Name, metav1.GetOptions{}); err == nil {
			cur.Spec = want.Spec
			_, err = api.Update(ctx, cur, metav1.UpdateOptions{})
		}
	}
	if err != nil {
		return fmt.Errorf("applying the boxes' egress NetworkPolicy: %w", err)
	}
	return nil
}

// withEgress attaches the Pod of a running box to the gateway under the
// backend's policy and returns the box that reports its refusals and can
// be narrowed and cut. A Pod without a network is conn itself; one whose
// network leads to another gateway is refused (see above).
func (b *Backend) withEgress(conn *sandbox.AgentConn, pod *corev1.Pod, log *slog.Logger) (sandbox.Sandbox, error) {
	via := pod.Labels[LabelEgress]
	if via == "" {
		return conn, nil
	}
	if err := b.sameGateway(via); err != nil {
		return nil, err
	}
	ip, err := netip.ParseAddr(pod.Status.PodIP)
	if err != nil {
		return nil, fmt.Errorf("the box's Pod has no IP the gateway can know it by (%q)", pod.Status.PodIP)
	}
	att, err := b.opts.Egress.AttachAddr(ip, egress.BoxInfo{Session: conn.ID(), Policy: b.opts.Policy})
	if err != nil {
		return nil, fmt.Errorf("attaching the box to the egress gateway: %w", err)
	}
	log.Debug("egress attached", "ip", ip.String())
	return &netBox{AgentConn: conn, att: att}, nil
}

// sameGateway refuses a box whose network leads to the gateway at via
// (its LabelEgress) unless that is this replica's: another's rules cannot
// be held here.
func (b *Backend) sameGateway(via string) error {
	n := b.podNet()
	if n == nil {
		return fmt.Errorf("the box's network leads to the egress gateway at %s, and this replica has none (no --allow-net): it cannot hold its rules", via)
	}
	if via != n.Gateway.String() {
		return fmt.Errorf("the box's network leads to the egress gateway at %s, not this replica's (%s): this replica cannot hold its rules", via, n.Gateway)
	}
	return nil
}

// netBox is a box with a network: what only the gateway knows, on top of
// the agent connection.
type netBox struct {
	*sandbox.AgentConn
	att *egress.Attachment
}

var (
	_ sandbox.RefusalReporter = (*netBox)(nil)
	_ sandbox.NetworkCutter   = (*netBox)(nil)
)

// Close detaches the box from the gateway and ends it (its Pod goes).
func (b *netBox) Close() error { return errors.Join(b.att.Close(), b.AgentConn.Close()) }

// NetworkRefusals says which connections the policy refused since the
// last call, in words for the model.
func (b *netBox) NetworkRefusals() []string { return b.att.NetworkRefusals() }

// CutNetwork makes the gateway refuse everything the box asks from now
// on: its Pod's NetworkPolicy lets it reach nothing else.
func (b *netBox) CutNetwork() error { return b.att.CutNetwork() }

// RestrictNetwork narrows what the gateway lets the box reach.
func (b *netBox) RestrictNetwork(hosts []string) error { return b.att.RestrictNetwork(hosts) }
