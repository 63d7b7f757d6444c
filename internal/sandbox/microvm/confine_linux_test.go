package microvm_test

import (
	"fmt"
	"os"
	"strings"
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
}
