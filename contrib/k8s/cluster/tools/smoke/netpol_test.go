package smoke

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	netv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// TestNetworkPolicyEnforced proves the cluster enforces a default-deny
// NetworkPolicy like the one kiln applies to its boxes (the bridge CNI
// enforces none; cluster.sh runs kube-router's firewall for that). A box
// Pod and a peer Pod both listen on TCP; the test listens on TCP and UDP
// on every host address. First, with no policy, each probe must get
// through (so the probes can see a way out); then, under the policy, none
// may: box to peer, peer to box, box to the node's addresses (TCP, UDP,
// the registry's port), box to its nameservers, while exec into the box
// (the apiserver to kubelet stream kiln's agent protocol uses) still works.
func TestNetworkPolicyEnforced(t *testing.T) {
	cfg, cs, reg := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ref := pushProbe(t, reg)
	ns := "kiln-netpol-" + rand.String(6)
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cs.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	})

	boxLabels := map[string]string{"app.kubernetes.io/managed-by": "kiln", "app.kubernetes.io/component": "box"}
	box := startServer(ctx, t, cs, ns, "box", ref, boxLabels)
	peer := startServer(ctx, t, cs, ns, "peer", ref, map[string]string{"app.kubernetes.io/name": "kiln-smoke"})
	// The host's addresses once a Pod runs (the CNI makes the bridge then).
	var hostTCP, hostUDP, hostReg []string
	for _, ip := range hostIPv4s(t) {
		tcp, udp := hostListeners(t, ip)
		hostTCP, hostUDP = append(hostTCP, tcp), append(hostUDP, udp)
		hostReg = append(hostReg, net.JoinHostPort(ip, regPort(reg)))
	}
	boxAddr, peerAddr := net.JoinHostPort(box.Status.PodIP, "8080"), net.JoinHostPort(peer.Status.PodIP, "8080")

	// What gets through, probed from inside the Pods through exec.
	probe := func() map[string]string {
		got := map[string]string{}
		for _, l := range lines(execIn(ctx, t, cfg, cs, ns, box.Name, append([]string{"/probe", "dial", peerAddr}, hostTCP...)...)) {
			got["box→tcp "+l[1]] = l[0]
		}
		for _, l := range lines(execIn(ctx, t, cfg, cs, ns, box.Name, append([]string{"/probe", "udp"}, hostUDP...)...)) {
			got["box→udp "+l[1]] = l[0]
		}
		for _, l := range lines(execIn(ctx, t, cfg, cs, ns, peer.Name, "/probe", "dial", boxAddr)) {
			got["peer→tcp "+l[1]] = l[0]
		}
		return got
	}
	open := func(got map[string]string) (through []string) {
		for k, v := range got {
			if v == "OPEN" || v == "ANSWER" {
				through = append(through, k)
			}
		}
		return through
	}
	before := probe()
	if n := len(open(before)); n != len(before) || n != 2+2*len(hostTCP) {
		t.Fatalf("without a policy every probe must get through, else the test proves nothing: %v", before)
	}
	t.Logf("without a policy: %v; the box's nameservers: %s", before,
		strings.TrimSpace(execIn(ctx, t, cfg, cs, ns, box.Name, "/probe", "dns")))

	pol := &netv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "kiln-boxes-deny-all"},
		Spec: netv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: boxLabels},
			PolicyTypes: []netv1.PolicyType{netv1.PolicyTypeIngress, netv1.PolicyTypeEgress},
		},
	}
	if _, err := cs.NetworkingV1().NetworkPolicies(ns).Create(ctx, pol, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The enforcer applies the policy some time after it is created.
	var after map[string]string
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		after = probe()
		return len(open(after)) == 0, nil
	})
	if err != nil {
		t.Fatalf("under a default-deny policy these still get through: %v", open(after))
	}
	for _, l := range lines(execIn(ctx, t, cfg, cs, ns, box.Name, append([]string{"/probe", "dial"}, hostReg...)...)) {
		if l[0] != "CLOSED" {
			t.Errorf("box reaches the registry's port at %s", l[1])
		}
	}
	for _, l := range lines(execIn(ctx, t, cfg, cs, ns, box.Name, "/probe", "dns")) {
		if l[0] != "NONE" {
			t.Errorf("box's DNS query to %s was answered", l[1])
		}
	}
	if out := execIn(ctx, t, cfg, cs, ns, box.Name, "/probe", "echo", "still", "attached"); out != "still attached\n" {
		t.Errorf("exec under the policy: got %q", out)
	}
}

// hostListeners listens on TCP and UDP (an echo) on ip, on ports the
// kernel picks, until the test ends. (One UDP socket per address: one on
// 0.0.0.0 would answer from whichever address routes back to the Pod.)
func hostListeners(t *testing.T, ip string) (tcp, udp string) {
	l, err := net.Listen("tcp4", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	u, err := net.ListenPacket("udp4", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { u.Close() })
	go func() {
		b := make([]byte, 512)
		for {
			n, from, err := u.ReadFrom(b)
			if err != nil {
				return
			}
			_, _ = u.WriteTo(b[:n], from)
		}
	}()
	return l.Addr().String(), u.LocalAddr().String()
}

// hostIPv4s are the host's non-loopback IPv4 addresses: the bridge's
// (the Pods' gateway) and the node's.
func hostIPv4s(t *testing.T) []string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	var ips []string
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
			ips = append(ips, n.IP.String())
		}
	}
	if len(ips) == 0 {
		t.Fatal("no host IPv4 address")
	}
	return ips
}

func regPort(reg string) string {
	if _, p, err := net.SplitHostPort(reg); err == nil {
		return p
	}
	return "5000"
}

// lines splits probe's output into its "VERDICT ADDR" pairs.
func lines(out string) [][2]string {
	var ls [][2]string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if w := strings.Fields(l); len(w) == 2 {
			ls = append(ls, [2]string{w[0], w[1]})
		}
	}
	return ls
}

// startServer runs probe serve 8080 in a hardened Pod and waits until it
// is Running with an IP.
func startServer(ctx context.Context, t *testing.T, cs *kubernetes.Clientset, ns, name, ref string, labels map[string]string) *corev1.Pod {
	no, yes := false, true
	uid := int64(65534)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken:  &no,
			EnableServiceLinks:            &no,
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: new(int64),
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: &yes, RunAsUser: &uid, RunAsGroup: &uid,
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			Containers: []corev1.Container{{
				Name:  "probe",
				Image: ref,
				Args:  []string{"serve", "8080"},
				SecurityContext: &corev1.SecurityContext{
					AllowPrivilegeEscalation: &no,
					ReadOnlyRootFilesystem:   &yes,
					Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				},
				Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{
					corev1.ResourceMemory: resource.MustParse("64Mi"),
					corev1.ResourceCPU:    resource.MustParse("500m"),
				}},
			}},
		},
	}
	if _, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var last *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		last = p
		if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
			return false, fmt.Errorf("pod ended: %s", p.Status.Phase)
		}
		return p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "", nil
	})
	if err != nil {
		t.Fatalf("pod %s not Running: %v\nstatus: %+v\nevents:\n%s", name, err, last.Status, events(ctx, cs, ns))
	}
	return last
}
