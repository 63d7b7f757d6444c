package microvm

import (
	"slices"
	"strings"
	"testing"

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
	c := kernelCmdline(l, []string{"numpy", "pandas"}, false, 2600002, "serial")
	kernel, initArgs, ok := strings.Cut(c, " -- ")
	if !ok {
		t.Fatalf("no init arguments in %q", c)
	}
	want := guestinit.DefaultParams()
	want.WorkspaceBytes, want.TmpBytes, want.Inodes, want.Pids, want.OpenFiles, want.MemoryBytes = 10, 20, 30, 40, 50, 60
	want.UID, want.GID, want.Transport = guestUID, guestUID, "serial"
	if p := guestinit.ParseCmdline(c); p != want {
		t.Errorf("guest reads %+v from %q, want %+v", p, c, want)
	}
	if p := guestinit.ParseCmdline(kernelCmdline(l, nil, false, 0, "vsock")); p.Transport != "vsock" {
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
