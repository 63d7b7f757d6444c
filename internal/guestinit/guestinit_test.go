package guestinit

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParseCmdline(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     func(*Params)
	}{
		{"empty", "", func(*Params) {}},
		{"kiln params", "console=ttyS0 root=/dev/vdb rootfstype=squashfs kiln.work_size=1048576 kiln.tmp_size=2048 kiln.inodes=99 kiln.uid=1001 kiln.gid=1002 kiln.hostname=box-1 kiln.pids=64 kiln.nofile=128 kiln.mem=4096 kiln.port=p",
			func(p *Params) {
				p.Root, p.RootFSType = "/dev/vdb", "squashfs"
				p.WorkspaceBytes, p.TmpBytes, p.Inodes = 1048576, 2048, 99
				p.UID, p.GID, p.Hostname, p.Pids, p.OpenFiles, p.Port, p.MemoryBytes = 1001, 1002, "box-1", 64, 128, "p", 4096
			}},
		{"malformed values keep defaults", "kiln.work_size=-5 kiln.tmp_size=abc kiln.uid=-1 kiln.hostname=bad/name kiln.inodes=", func(*Params) {}},
		{"init args ignored", "ro -- kiln.work_size=5 -guest", func(*Params) {}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := defaults
			tc.want(&want)
			if d := cmp.Diff(want, ParseCmdline(tc.in)); d != "" {
				t.Errorf("ParseCmdline(%q) (-want +got):\n%s", tc.in, d)
			}
		})
	}
}

func TestMerge(t *testing.T) {
	p := defaults
	p.WorkspaceBytes = 7
	got := Config{TmpBytes: 9, Hostname: "h"}.merge(p)
	want := Config{Workspace: "/work", WorkspaceBytes: 7, TmpBytes: 9, Inodes: p.Inodes, UID: 1000, GID: 1000, Hostname: "h", Pids: p.Pids, OpenFiles: p.OpenFiles, MemoryBytes: p.MemoryBytes}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("merge (-want +got):\n%s", d)
	}
}

// TestMounts pins the security-relevant properties of the mount table.
func TestMounts(t *testing.T) {
	cfg := Config{Workspace: "/work", WorkspaceBytes: 1 << 20, TmpBytes: 2 << 20, Inodes: 10, UID: 1000, GID: 1000}
	seen := map[string]mount{}
	for _, m := range mounts(cfg) {
		seen[m.target] = m
		if m.flags&msNosuid == 0 {
			t.Errorf("%s is mounted without nosuid", m.target)
		}
	}
	for target, want := range map[string]string{
		"/work": "size=1048576,nr_inodes=10,uid=1000,gid=1000",
		"/tmp":  "size=2097152,nr_inodes=10",
		"/proc": "hidepid=2",
	} {
		if !strings.Contains(seen[target].data, want) {
			t.Errorf("%s mounted with %q, want it to contain %q", target, seen[target].data, want)
		}
	}
	if seen["/sys"].flags&msRdonly == 0 {
		t.Error("/sys is writable")
	}
}

func TestParseModules(t *testing.T) {
	got := ParseModules("# order\n/lib/modules/a.ko\n\n  /lib/modules/b.ko  \n")
	if d := cmp.Diff([]string{"/lib/modules/a.ko", "/lib/modules/b.ko"}, got); d != "" {
		t.Error(d)
	}
}

func TestSysctls(t *testing.T) {
	last := sysctls[len(sysctls)-1]
	if last.key != "kernel/modules_disabled" {
		t.Errorf("modules_disabled must come last, after everything that may load a module; last is %s", last.key)
	}
	for _, sc := range sysctls {
		if sc.key == "user/max_user_namespaces" && sc.value == "0" {
			return
		}
	}
	t.Error("user namespaces are not disabled")
}

// TestCmdlineRoundTrip: what the host writes (Cmdline) the guest reads
// back (ParseCmdline) as written, hostile strings included, and no value
// can add a parameter of its own or reach init's arguments.
func TestCmdlineRoundTrip(t *testing.T) {
	hostile := []string{"a b", "x kiln.uid=0", "-- -uid=0", `"quoted"`, "tab\there", "line\nbreak", "100%", "%zz", "=", "p=q", "ünïcode", "kiln.port=x"}
	base := defaults
	base.WorkspaceBytes, base.TmpBytes, base.Inodes, base.MemoryBytes = 1<<20+1, 3<<20, 77, 5<<30
	base.UID, base.GID, base.Pids, base.OpenFiles = 0, 4242, 9, 99
	base.Transport, base.VsockPort, base.Hostname = "vsock", 1<<32-1, "box-1.kiln"
	cases := []Params{defaults, base}
	for _, h := range hostile {
		p := base
		p.Port = h
		cases = append(cases, p)
	}
	for _, p := range cases {
		if err := p.Validate(); err != nil {
			t.Errorf("Validate(%+v): %v", p, err)
		}
		line := "console=ttyS0 " + strings.Join(p.Cmdline(), " ") + " -- -guest"
		if d := cmp.Diff(p, ParseCmdline(line)); d != "" {
			t.Errorf("ParseCmdline(%q) (-wrote +read):\n%s", line, d)
		}
	}
	// What the guest would not read back, the host is told of.
	for _, bad := range []func(*Params){
		func(p *Params) { p.Hostname = "a b" },
		func(p *Params) { p.Hostname = "x kiln.uid=0" },
		func(p *Params) { p.Transport = "tcp" },
		func(p *Params) { p.WorkspaceBytes = 0 },
		func(p *Params) { p.Pids = -1 },
		func(p *Params) { p.Root = "/dev/vda kiln.uid=0" },
		func(p *Params) { p.Port = "" },
	} {
		p := base
		bad(&p)
		if p.Validate() == nil {
			t.Errorf("Validate(%+v) accepts what ParseCmdline would not read back", p)
		}
	}
}
