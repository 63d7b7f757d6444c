package microvm

import (
	"os"
	"slices"
	"strings"
	"testing"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox/boxkit"
)

// TestJail runs a shell in QEMU's jail and looks from inside: the /dev/kvm
// node made for its uid opens read-write, it has no capabilities and
// cannot gain any, it is not root on the host, and its root holds only
// what QEMU needs.
func TestJail(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("jailing QEMU needs root")
	}
	if _, err := os.Stat("/dev/kvm"); err != nil {
		t.Skip("needs /dev/kvm")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Open(exe)
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	dir := t.TempDir()
	uid := int(boxpolicy.VMMUIDs.First) + 4242
	node, err := kvmNode(dir, uid)
	if err != nil {
		t.Fatal(err)
	}
	script := `echo fds: $(ls /proc/self/fd)
exec 3<>/dev/kvm && echo kvm-opened
while read -r l; do echo "$l"; done </proc/self/status
echo root: $(ls -a /)
cat /etc/shadow 2>/dev/null && echo shadow-read
ls /root 2>/dev/null && echo root-listed
echo x >/usr/kiln-test 2>/dev/null && echo usr-written
echo done`
	cmd, opened, err := jailCommand(self, uid, "/usr/bin/dash", []string{"-c", script}, nil,
		[]boxkit.Bind{{Src: node, Dst: "/dev/kvm", Dev: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer boxkit.CloseFiles(opened)
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("running the jail: %v", err)
	}
	lines := strings.Split(string(out), "\n")
	for _, want := range []string{
		"kvm-opened",
		"CapEff:\t0000000000000000", "CapPrm:\t0000000000000000", "CapBnd:\t0000000000000000", "CapAmb:\t0000000000000000",
		"NoNewPrivs:\t1",
		"fds: 0 1 2 3", // stdio and ls's own: none of the init's
		"done",
	} {
		if !slices.Contains(lines, want) {
			t.Errorf("the jail's output lacks %q", want)
		}
	}
	for _, l := range lines {
		if k, v, ok := strings.Cut(l, ":"); ok && (k == "Uid" || k == "Gid") && strings.Fields(v)[0] != "0" {
			t.Errorf("%s inside the jail: %s, want 0 (the VM's host uid)", k, v)
		}
		if r, ok := strings.CutPrefix(l, "root: "); ok {
			for _, e := range strings.Fields(r) {
				if !slices.Contains([]string{".", "..", "dev", "etc", "proc", "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"}, e) {
					t.Errorf("the jail's root holds %s", e)
				}
			}
		}
	}
	for _, bad := range []string{"shadow-read", "root-listed", "usr-written"} {
		if slices.Contains(lines, bad) {
			t.Errorf("in the jail: %s", bad)
		}
	}
}
