package wasm

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

func TestMain(m *testing.M) {
	MaybeInit() // a box's Deno is started through this binary's confinement init
	os.Exit(m.Run())
}

// TestDenoConfined looks at a running box's Deno process from the host:
// not root and not any real user, no capabilities and no way to gain one,
// under a seccomp filter, in user, mount, network, pid, ipc and uts
// namespaces of its own, with no network interface but loopback, and a
// root that holds none of the host's files beyond its libraries.
func TestDenoConfined(t *testing.T) {
	b := newTestBackend(t)
	bx := newBox(t, b, 0).(*box)
	if out, errText := run(t, bx, "print(6*7)"); strings.TrimSpace(out) != "42" || errText != "" {
		t.Fatalf("the box does not run python: %q %q", out, errText)
	}
	pid := bx.cmd.Process.Pid
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	status := string(st)
	for _, want := range []string{
		"CapEff:\t0000000000000000", "CapPrm:\t0000000000000000", "CapBnd:\t0000000000000000", "CapAmb:\t0000000000000000", "CapInh:\t0000000000000000",
		"NoNewPrivs:\t1", "Seccomp:\t2",
	} {
		if !strings.Contains(status, want+"\n") {
			t.Errorf("deno's status lacks %q", want)
		}
	}
	for _, line := range strings.Split(status, "\n") {
		k, v, _ := strings.Cut(line, ":")
		if k != "Uid" && k != "Gid" && k != "Groups" {
			continue
		}
		for _, f := range strings.Fields(v) {
			n, _ := strconv.Atoi(f)
			if n == 0 || os.Geteuid() == 0 && n < denoUIDBase {
				t.Errorf("deno runs as host %s %s, want a uid no real user has", k, strings.TrimSpace(v))
				break
			}
		}
	}
	for _, ns := range []string{"user", "mnt", "net", "pid", "ipc", "uts"} {
		self, err1 := os.Readlink("/proc/self/ns/" + ns)
		deno, err2 := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
		if err1 != nil || err2 != nil || self == deno {
			t.Errorf("deno shares the host's %s namespace (%s %v %v)", ns, deno, err1, err2)
		}
	}
	dev, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/dev", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(dev), "\n")[2:] {
		if name, _, ok := strings.Cut(strings.TrimSpace(line), ":"); ok && name != "lo" {
			t.Errorf("deno's network has interface %s", name)
		}
	}
	root := fmt.Sprintf("/proc/%d/root", pid)
	for _, p := range []string{"/etc/passwd", "/etc/shadow", "/root", "/home", "/var", "/tmp"} {
		if _, err := os.Lstat(root + p); err == nil {
			t.Errorf("deno's root holds %s", p)
		}
	}
	if f, err := os.OpenFile(root+"/pyodide/kiln-write-test", os.O_CREATE|os.O_WRONLY, 0o600); err == nil {
		f.Close()
		os.Remove(root + "/pyodide/kiln-write-test")
		t.Errorf("deno's pyodide directory is writable")
	}
}

// BenchmarkDenoStart is what confinement adds to a box's start: deno
// --version started plainly (as before) and through the confinement init
// (namespaces, binds, capabilities, the seccomp filter).
func BenchmarkDenoStart(b *testing.B) {
	if _, err := Installed(""); err != nil {
		b.Skip(err)
	}
	bk, err := New(Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer bk.Close()
	b.Run("plain", func(b *testing.B) {
		for b.Loop() {
			cmd := exec.Command(bk.rt.Deno, "--version")
			cmd.Env = bk.env(bk.hostDir)
			if out, err := cmd.CombinedOutput(); err != nil {
				b.Fatalf("%v: %s", err, out)
			}
		}
	})
	b.Run("confined", func(b *testing.B) {
		for b.Loop() {
			cmd, opened, err := bk.plat.command(bk.hostPaths(""), func(paths) []string { return []string{"--version"} })
			if err != nil {
				b.Fatal(err)
			}
			out, err := cmd.CombinedOutput()
			closeAll(opened)
			if err != nil {
				b.Fatalf("%v: %s", err, out)
			}
		}
	})
}
