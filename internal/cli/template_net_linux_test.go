package cli

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"kiln/internal/boxtemplate"
	"kiln/internal/egress"
	"kiln/internal/egress/egresstest"
	"kiln/internal/sandbox"
	"kiln/internal/sandbox/sandboxtest"
)

// TestTemplatePipThroughAllowlist makes a template whose setup pip-installs
// a wheel from a package index on a local "internet" (python -m
// http.server in its own network namespace, reached over a veth), through
// the egress gateway under the template's allowlist; a server started
// with the template imports it. The same setup without the allowlist
// fails and keeps nothing.
func TestTemplatePipThroughAllowlist(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root (network namespaces, veth pairs, the jail)")
	}
	if err := exec.Command("ip", "netns", "list").Run(); err != nil {
		t.Skipf("ip netns does not work: %v", err)
	}
	agent := sandboxtest.BuildAgent(t)
	web := localIndex(t)

	gw, err := egress.NewGateway(egress.Options{
		Hosts:                map[string][]netip.Addr{"pypi.test": {web}},
		TestOnlyAllowedAddrs: []netip.Prefix{netip.PrefixFrom(web, 32)},
	})
	if err != nil {
		t.Skipf("egress gateway unavailable: %v", err)
	}
	defer gw.Close()
	policy, err := egress.ParsePolicy("pypi.test")
	if err != nil {
		t.Fatal(err)
	}
	dir := templateStore(t)
	store, err := boxtemplate.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	setup := filepath.Join(t.TempDir(), "setup.sh")
	os.WriteFile(setup, []byte(`python3 -m pip install --isolated --disable-pip-version-check --no-cache-dir --retries 0 --timeout 10 \
  --index-url http://pypi.test/simple/ --trusted-host pypi.test --target "$KILN_TEMPLATE_FILES/python" kilnprobe
`), 0o644)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	mk := func(name string, n *network) error {
		_, err := createTemplate(ctx, templateSetup{name: name, store: store, setup: setup, agent: agent, imports: []string{"kilnprobe"},
			limits: sandbox.Limits{MemoryBytes: 1 << 30}, timeout: 2 * time.Minute, out: &out, log: slog.New(slog.DiscardHandler), net: n})
		return err
	}
	if err := mk("pip", &network{policy: policy, gateway: gw}); err != nil {
		t.Fatalf("creating the template: %v\n%s", err, out.String())
	}
	if err := mk("nonet", &network{}); err == nil {
		t.Errorf("pip install without the allowlist worked:\n%s", out.String())
	}
	if _, err := store.Load("nonet", "", ""); err == nil || !strings.Contains(err.Error(), "no such template") {
		t.Errorf("the failed template was kept: %v", err)
	}

	st := startObserved(t, "--agent", agent, "--mode", "per-call", "--template", "pip", "--template-dir", dir, "--preload", "")
	defer st.close()
	// A call that arrives while the zygote template still imports the
	// template's modules gets a box started directly, without them
	// (sandbox.Spec.Urgent); the module must import there too. Boxes
	// from the ready template have it imported already.
	got := untilPreloaded(t, clientOf(t, st), `import sys; print("preloaded", "kilnprobe" in sys.modules); import kilnprobe; print(kilnprobe.VALUE)`)
	if !strings.Contains(got, "preloaded True") || !strings.Contains(got, "kiln-probe-ok") {
		t.Errorf("the pip-installed module is not in the box:\n%s", got)
	}
}

// localIndex serves a simple package index holding one wheel, kilnprobe,
// with python -m http.server on port 80 of a network namespace linked to
// this one by a veth, and returns its address.
func localIndex(t *testing.T) netip.Addr {
	t.Helper()
	k := 20 + os.Getpid()%200
	name := fmt.Sprintf("kt-tpl%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Skipf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	ns, err := netns.GetFromName(name)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	hostAddr := netip.AddrFrom4([4]byte{10, 78, byte(k), 1})
	webAddr := netip.AddrFrom4([4]byte{10, 78, byte(k), 2})
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: fmt.Sprintf("kt%d", os.Getpid())}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(ns))}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("creating the veth: %v", err)
	}
	t.Cleanup(func() { netlink.LinkDel(veth) })
	if err := netlink.AddrAdd(veth, &netlink.Addr{IPNet: &net.IPNet{IP: hostAddr.AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(veth); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"addr", "add", webAddr.String() + "/24", "dev", "eth0"}, {"link", "set", "eth0", "up"}, {"link", "set", "lo", "up"}} {
		if out, err := exec.Command("ip", append([]string{"-n", name}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}

	root := t.TempDir()
	wheelName, wheel := egresstest.Wheel(t)
	os.MkdirAll(filepath.Join(root, "simple", "kilnprobe"), 0o755)
	os.MkdirAll(filepath.Join(root, "packages"), 0o755)
	os.WriteFile(filepath.Join(root, "packages", wheelName), wheel, 0o644)
	sum := sha256.Sum256(wheel)
	os.WriteFile(filepath.Join(root, "simple", "kilnprobe", "index.html"),
		[]byte(fmt.Sprintf("<!DOCTYPE html><html><body><a href=\"/packages/%s#sha256=%x\">%s</a></body></html>\n", wheelName, sum, wheelName)), 0o644)
	srv := exec.Command("ip", "netns", "exec", name, "python3", "-m", "http.server", "--bind", webAddr.String(), "--directory", root, "80")
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	for i := 0; ; i++ {
		c, err := net.DialTimeout("tcp", webAddr.String()+":80", time.Second)
		if err == nil {
			c.Close()
			break
		}
		if i == 50 {
			t.Fatalf("the index does not answer: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return webAddr
}
