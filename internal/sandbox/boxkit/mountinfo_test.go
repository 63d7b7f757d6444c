package boxkit

import (
	"strings"
	"testing"
)

// TestParseMountinfo feeds real mountinfo lines: optional fields vary in
// number, and paths carry the kernel's escapes for space, tab, newline and
// backslash.
func TestParseMountinfo(t *testing.T) {
	in := `36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue
1288 1220 0:152 / /tmp/kiln-jail/state\040dir/root-1.2-x rw,relatime - tmpfs tmpfs rw,size=1024k
30 24 0:26 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:11 master:3 - cgroup cgroup rw,memory
40 24 0:30 /a\011b\012c\134d /mnt/odd\134name\040 rw - ext4 /dev/disk\040one rw
garbage line
41 24 0:30 / /short rw
`
	got, err := ParseMountinfo(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []Mount{
		{ID: 36, Parent: 35, Root: "/mnt1", Point: "/mnt/parent", Options: "rw,noatime", FSType: "ext3", Source: "/dev/root", SuperOptions: "rw,errors=continue"},
		{ID: 1288, Parent: 1220, Root: "/", Point: "/tmp/kiln-jail/state dir/root-1.2-x", Options: "rw,relatime", FSType: "tmpfs", Source: "tmpfs", SuperOptions: "rw,size=1024k"},
		{ID: 30, Parent: 24, Root: "/", Point: "/sys/fs/cgroup/memory", Options: "rw,nosuid,nodev,noexec,relatime", FSType: "cgroup", Source: "cgroup", SuperOptions: "rw,memory"},
		{ID: 40, Parent: 24, Root: "/a\tb\nc\\d", Point: `/mnt/odd\name `, Options: "rw", FSType: "ext4", Source: "/dev/disk one", SuperOptions: "rw"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d mounts, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("mount %d:\n got %+v\nwant %+v", i, got[i], want[i])
		}
	}
}

func TestMountinfoUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`:      "/plain",
		`/a\040b`:     "/a b",
		`/end\040`:    "/end ",
		`/cut\04`:     `/cut\04`,
		`/not\999oct`: `/not\999oct`,
		`\134\134`:    `\\`,
		`/x\012\011y`: "/x\n\ty",
	} {
		if got := mountinfoUnescape(in); got != want {
			t.Errorf("mountinfoUnescape(%q) = %q; want %q", in, got, want)
		}
	}
}
