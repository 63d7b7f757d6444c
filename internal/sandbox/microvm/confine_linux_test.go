package microvm_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"

	"kiln/internal/sandbox"
	"kiln/internal/sandbox/microvm"
)

// TestQEMUConfinement checks what the host does to the VMM itself: its own
// network, ipc, uts, mount and pid namespaces, its own cgroup, and QEMU's
// seccomp filter.
func TestQEMUConfinement(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("confining QEMU needs root")
	}
	b := newBackend(t, microvm.Options{})
	create(t, b, sandbox.Spec{ID: "confined", Preload: []string{"numpy", "pandas"}})
	pids := microvm.QEMUPIDs(b)
	if len(pids) != 1 {
		t.Fatalf("%d QEMU processes, want 1", len(pids))
	}
	pid := pids[0]
	for _, ns := range []string{"net", "ipc", "uts", "mnt", "pid_for_children"} {
		self, err1 := os.Readlink("/proc/self/ns/" + ns)
		vmm, err2 := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
		if ns == "pid_for_children" {
			self, err1 = os.Readlink("/proc/self/ns/pid")
			vmm, err2 = os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid))
		}
		if err1 != nil || err2 != nil || self == vmm {
			t.Errorf("QEMU shares the host's %s namespace (%s %v %v)", ns, vmm, err1, err2)
		}
	}
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil || !strings.Contains(string(cg), "kiln-microvm/confined") {
		t.Errorf("QEMU is not in its own cgroup:\n%s", cg)
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil || !strings.Contains(string(st), "Seccomp:\t2") {
		t.Errorf("QEMU runs without a seccomp filter")
	}

	// Deprivileged like Firecracker's jailer: an unprivileged host uid in
	// its own user namespace, no capabilities, no way to gain any.
	for _, want := range []string{"CapEff:\t0000000000000000", "CapPrm:\t0000000000000000", "CapBnd:\t0000000000000000", "NoNewPrivs:\t1"} {
		if !strings.Contains(string(st), want+"\n") {
			t.Errorf("QEMU status lacks %q", want)
		}
	}
	for _, line := range strings.Split(string(st), "\n") {
		if k, v, _ := strings.Cut(line, ":"); k == "Uid" || k == "Gid" {
			for _, id := range strings.Fields(v) {
				if n, _ := strconv.Atoi(id); n < 1<<20 {
					t.Errorf("QEMU runs as host %s %s, want a uid no real user has", k, id)
				}
			}
		}
	}
	self, err1 := os.Readlink("/proc/self/ns/user")
	vmm, err2 := os.Readlink(fmt.Sprintf("/proc/%d/ns/user", pid))
	if err1 != nil || err2 != nil || self == vmm {
		t.Errorf("QEMU shares the host's user namespace (%s %v %v)", vmm, err1, err2)
	}
	// What QEMU sees as its root holds nothing of the host's secrets.
	root := fmt.Sprintf("/proc/%d/root", pid)
	for _, p := range []string{"/etc/shadow", "/etc/passwd", "/root", "/home", "/tmp", "/usr/bin/sudo", "/var"} {
		if _, err := os.Lstat(root + p); err == nil {
			t.Errorf("QEMU's root holds %s", p)
		}
	}
	for _, p := range []string{"/usr", "/dev/null", "/dev/urandom"} {
		if _, err := os.Stat(root + p); err != nil {
			t.Errorf("QEMU's root lacks %s: %v", p, err)
		}
	}
	// Its root is not writable where the host's files are.
	if f, err := os.OpenFile(root+"/usr/kiln-write-test", os.O_CREATE|os.O_WRONLY, 0o600); err == nil {
		f.Close()
		os.Remove(root + "/usr/kiln-write-test")
		t.Errorf("QEMU's /usr is writable")
	}
}

// TestConcurrentCreate starts clones at once: each jailed QEMU's init must
// come up while others do (it once closed its own runtime's descriptors
// and crashed now and then).
func TestConcurrentCreate(t *testing.T) {
	b := newBackend(t, microvm.Options{})
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			sb, err := b.Create(ctx, sandbox.Spec{ID: fmt.Sprint("concurrent-", i), Preload: []string{"numpy", "pandas"}})
			if err != nil {
				t.Errorf("creating box %d: %v", i, err)
				return
			}
			sb.Close()
		}()
	}
	wg.Wait()
}
