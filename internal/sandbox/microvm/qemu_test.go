package microvm

import (
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"kiln/internal/boxpolicy"
	"kiln/internal/guestinit"
	"kiln/internal/sandbox"
)

func argValue(args []string, flag string) []string {
	var out []string
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag {
			out = append(out, args[i+1])
		}
	}
	return out
}

func TestArgs(t *testing.T) {
	base := vmConfig{QEMU: "q", Accel: AccelTCG, MemoryMiB: 512, CPUs: 2, Kernel: "/k", Initrd: "/i", Rootfs: "/r,x", Cmdline: "c"}
	for _, tc := range []struct {
		name  string
		mut   func(*vmConfig)
		check func(t *testing.T, a []string)
	}{
		{"no network, read-only root, fd sockets", func(*vmConfig) {}, func(t *testing.T, a []string) {
			for _, x := range a {
				if strings.Contains(x, "netdev") || strings.Contains(x, "virtio-net") {
					t.Errorf("network device in %q", x)
				}
			}
			if !slices.Contains(a, "-nodefaults") {
				t.Error("default devices not disabled")
			}
			if d := argValue(a, "-drive"); len(d) != 1 || !strings.Contains(d[0], "readonly=on") || !strings.Contains(d[0], "file=/r,,x") {
				t.Errorf("drive %q", d)
			}
			ch := strings.Join(argValue(a, "-chardev"), " ")
			if !strings.Contains(ch, "socket,id=agent,fd=3") || !strings.Contains(ch, "socket,id=qmp,fd=4") {
				t.Errorf("chardevs %q", ch)
			}
			if !slices.Contains(argValue(a, "-device"), "virtserialport,chardev=agent,name="+guestinit.PortName) {
				t.Error("no agent port")
			}
			if got := argValue(a, "-accel"); len(got) != 1 || !strings.HasPrefix(got[0], "tcg") {
				t.Errorf("accel %q", got)
			}
			if slices.Contains(a, "-incoming") {
				t.Error("cold boot waits for incoming state")
			}
		}},
		{"kvm", func(c *vmConfig) { c.Accel = AccelKVM }, func(t *testing.T, a []string) {
			if got := argValue(a, "-accel"); len(got) != 1 || got[0] != "kvm" {
				t.Errorf("accel %q", got)
			}
			if got := argValue(a, "-cpu"); got[0] != "host" {
				t.Errorf("cpu %q", got)
			}
		}},
		{"template", func(c *vmConfig) { c.MemFile, c.MemShared = "/m", true }, func(t *testing.T, a []string) {
			obj := strings.Join(argValue(a, "-object"), " ")
			if !strings.Contains(obj, "mem-path=/m,share=on") || !strings.Contains(obj, "size=512M") {
				t.Errorf("object %q", obj)
			}
		}},
		{"clone", func(c *vmConfig) { c.MemFile, c.Incoming = "/m", true }, func(t *testing.T, a []string) {
			if obj := strings.Join(argValue(a, "-object"), " "); !strings.Contains(obj, "share=off") {
				t.Errorf("clone maps template RAM shared: %q", obj)
			}
			if got := argValue(a, "-incoming"); len(got) != 1 || got[0] != "defer" {
				t.Errorf("incoming %q", got)
			}
		}},
		{"seccomp", func(c *vmConfig) { c.Seccomp = true }, func(t *testing.T, a []string) {
			s := argValue(a, "-sandbox")
			if len(s) != 1 || !strings.Contains(s[0], "spawn=deny") || !strings.Contains(s[0], "elevateprivileges=deny") {
				t.Errorf("sandbox %q", s)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.mut(&c)
			tc.check(t, c.args())
		})
	}
}

func TestKernelCmdline(t *testing.T) {
	l := sandbox.Limits{MemoryBytes: 60, WorkspaceBytes: 10, TmpBytes: 20, Inodes: 30, Pids: 40, OpenFiles: 50}
	c := kernelCmdline(l, nil, []string{"numpy", "pandas"}, false, 2600002, "serial")
	kernel, initArgs, ok := strings.Cut(c, " -- ")
	if !ok {
		t.Fatalf("no init arguments in %q", c)
	}
	plan := guestPlan(l, nil)
	want := guestinit.DefaultParams()
	want.Plan, want.MemoryBytes, want.Transport = &plan, 60, "serial"
	got := guestinit.ParseCmdline(c)
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("guest reads from %q (-want +got):\n%s", c, d)
	}
	// The plan the guest reads is the box plan every backend builds
	// from (boxpolicy.New), with these limits and the code's uid.
	if got.Plan == nil {
		t.Fatal("no plan on the command line")
	}
	shm := slices.IndexFunc(got.Plan.Tmpfs, func(tf boxpolicy.Tmpfs) bool { return tf.Path == boxpolicy.DevShm })
	if shm < 0 || got.Plan.Tmpfs[shm].Inodes != boxpolicy.DevShmInodes {
		t.Errorf("the guest's /dev/shm is not inode-capped: %+v", got.Plan.Tmpfs)
	}
	if w := got.Plan.Tmpfs[0]; w.Path != boxpolicy.Workspace || w.Size != 10 || w.Inodes != 30 || w.UID != guestUID {
		t.Errorf("workspace tmpfs %+v", w)
	}
	if !slices.Equal(got.Plan.ProcMasks, boxpolicy.ProcMasks) {
		t.Errorf("proc masks %q, want %q", got.Plan.ProcMasks, boxpolicy.ProcMasks)
	}
	if !slices.Contains(got.Plan.Rlimits, boxpolicy.Rlimit{Name: "RLIMIT_CORE", Value: 0}) || !slices.Contains(got.Plan.Rlimits, boxpolicy.Rlimit{Name: "RLIMIT_NPROC", Value: 40}) {
		t.Errorf("rlimits %+v", got.Plan.Rlimits)
	}
	if got.Plan.Digest() != plan.Digest() {
		t.Error("the plan the guest reads has another digest than the one the host checks its hello against")
	}
	if p := guestinit.ParseCmdline(kernelCmdline(l, nil, nil, false, 0, "vsock")); p.Transport != "vsock" {
		t.Errorf("guest reads transport %q, want vsock", p.Transport)
	}
	for _, w := range []string{"ro", "quiet", "tsc_early_khz=2600002"} {
		if !slices.Contains(strings.Fields(kernel), w) {
			t.Errorf("kernel args lack %q: %q", w, kernel)
		}
	}
	for _, w := range []string{"-guest", "-uid=1000", "-gid=1000", "-preload=numpy,pandas"} {
		if !slices.Contains(strings.Fields(initArgs), w) {
			t.Errorf("init args lack %q: %q", w, initArgs)
		}
	}
}

// TestKernelCmdlineFits: the longest command line kiln writes (large
// limits, a long preload list, a template, verbose, TCG's clock) fits in
// what the guest kernel keeps; a longer one would be cut, and with it
// the box plan.
func TestKernelCmdlineFits(t *testing.T) {
	l := sandbox.Limits{MemoryBytes: 1 << 40, WorkspaceBytes: 1 << 40, TmpBytes: 1 << 40, Inodes: 1 << 30, Pids: 1 << 20, OpenFiles: 1 << 20}
	preload := strings.Split("numpy,pandas,matplotlib,matplotlib.pyplot,scipy,scipy.stats,sklearn,seaborn,statsmodels.api,sympy", ",")
	c := kernelCmdline(l, nil, preload, true, 2600002, "vsock", guestinit.TemplateParam+"=/dev/vdb", "init="+guestinit.AgentPath)
	if len(c) > guestinit.MaxCmdline {
		t.Errorf("kernel command line of %d bytes, the kernel keeps %d: %s", len(c), guestinit.MaxCmdline, c)
	}
	t.Logf("%d of %d bytes", len(c), guestinit.MaxCmdline)
}

func TestCleanPreload(t *testing.T) {
	got := cleanPreload([]string{"numpy", "matplotlib.pyplot", "a b", "x=y", "-v", "", "os.path", "1abc"})
	want := []string{"numpy", "matplotlib.pyplot", "os.path"}
	if !slices.Equal(got, want) {
		t.Errorf("cleanPreload = %q, want %q", got, want)
	}
}

func TestGuestShape(t *testing.T) {
	for _, tc := range []struct {
		l    sandbox.Limits
		mem  int64
		cpus int
	}{
		{sandbox.Limits{MemoryBytes: 1 << 30, CPUs: 1}, 1024 + guestReserveMiB, 1},
		{sandbox.Limits{MemoryBytes: 1 << 20, CPUs: 0.5}, 64 + guestReserveMiB, 1},
		{sandbox.Limits{MemoryBytes: 2 << 30, CPUs: 1.5}, 2048 + guestReserveMiB, 2},
	} {
		mem, cpus := guestShape(tc.l)
		if mem != tc.mem || cpus != tc.cpus {
			t.Errorf("guestShape(%+v) = %d, %d; want %d, %d", tc.l, mem, cpus, tc.mem, tc.cpus)
		}
	}
}

func TestHostTSCKHz(t *testing.T) {
	if got := hostTSCKHz("processor\t: 0\ncpu MHz\t\t: 2600.002\n"); got != 2600002 {
		t.Errorf("got %d", got)
	}
	if got := hostTSCKHz("processor: 0\n"); got != 0 {
		t.Errorf("got %d without cpu MHz", got)
	}
}

// TestKernelCmdlineWithNetwork: a guest with a network (the gateway's
// proxy environment, three secrets' placeholders, the trust variables)
// and a template still fits the kernel's command line, and reads its
// network back. The plan is deflated: in plain JSON it does not fit.
func TestKernelCmdlineWithNetwork(t *testing.T) {
	l := sandbox.DefaultLimits
	proxy := "http://10.201.0.1:3128"
	n := &guestNet{
		plan: boxpolicy.Network{Gateway: "10.201.0.1", Transparent: "10.201.0.2", TrustBundle: true,
			ResolvConf: "# kiln egress gateway: answers only names the policy allows\nnameserver 10.201.0.1\noptions attempts:2 timeout:2\n"},
		env: []string{"HTTP_PROXY=" + proxy, "HTTPS_PROXY=" + proxy, "NO_PROXY=localhost,127.0.0.1,::1",
			"http_proxy=" + proxy, "https_proxy=" + proxy, "no_proxy=localhost,127.0.0.1,::1"},
	}
	for _, s := range []string{"GITHUB_TOKEN", "OPENAI_API_KEY", "HF_TOKEN"} {
		n.env = append(n.env, s+"=kiln-placeholder-0123456789abcdef0123456789abcdef")
	}
	for _, v := range []string{"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS"} {
		n.env = append(n.env, v+"="+boxpolicy.TrustBundle)
	}
	c := kernelCmdline(l, n, []string{"numpy", "pandas", "matplotlib.pyplot"}, true, 2600002, "serial", guestinit.TemplateParam+"=/dev/vdb")
	if err := checkCmdline(c); err != nil {
		t.Fatal(err)
	}
	got := guestinit.ParseCmdline(c).Plan
	if got == nil || got.Network == nil || *got.Network != n.plan || !slices.Equal(got.Env[len(got.Env)-len(n.env):], n.env) {
		t.Fatalf("the guest reads back %+v", got)
	}
	if got.Digest() != guestPlan(l, n).Digest() {
		t.Error("the plan the guest reads has another digest than the host's")
	}
	if checkCmdline(strings.Repeat("x", guestinit.MaxCmdline+1)) == nil {
		t.Error("a command line the kernel would cut was accepted")
	}
}
