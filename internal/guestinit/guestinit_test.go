package guestinit

import (
	"encoding/base64"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"kiln/internal/boxpolicy"
)

// testPlan is the plan of a box with small limits, as a host sends it.
func testPlan() *boxpolicy.Plan {
	p := boxpolicy.New(boxpolicy.Limits{WorkspaceBytes: 1 << 20, TmpBytes: 2 << 20, Inodes: 10, Pids: 64, OpenFiles: 128}, 1000, 1000)
	p.Landlock = nil
	return &p
}

func TestParseCmdline(t *testing.T) {
	plan := testPlan()
	enc := encodePlan(plan)
	for _, tc := range []struct {
		name, in string
		want     func(*Params)
	}{
		{"empty", "", func(*Params) {}},
		{"kiln params", "console=ttyS0 root=/dev/vdb rootfstype=squashfs kiln.plan=" + enc + " kiln.mem=4096 kiln.port=p",
			func(p *Params) {
				p.Root, p.RootFSType = "/dev/vdb", "squashfs"
				p.Plan, p.Port, p.MemoryBytes = plan, "p", 4096
			}},
		{"malformed values keep defaults", "kiln.mem=-5 kiln.plan=!!! kiln.transport=tcp kiln.port=", func(*Params) {}},
		{"plan not JSON", "kiln.plan=" + base64.RawURLEncoding.EncodeToString([]byte("{")), func(*Params) {}},
		{"init args ignored", "ro -- kiln.plan=" + enc + " -guest", func(*Params) {}},
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

// TestPlanRefused: a plan the guest could not build a box from is no
// plan (Setup then fails with ErrNoPlan): an rlimit it does not know, no
// workspace, a bad host name, a relative or unsized tmpfs.
func TestPlanRefused(t *testing.T) {
	for _, bad := range []func(*boxpolicy.Plan){
		func(p *boxpolicy.Plan) { p.Rlimits = append(p.Rlimits, boxpolicy.Rlimit{Name: "RLIMIT_AS", Value: 1}) },
		func(p *boxpolicy.Plan) { p.Workspace = "" },
		func(p *boxpolicy.Plan) { p.Hostname = "a b" },
		func(p *boxpolicy.Plan) { p.Tmpfs[1].Path = "tmp" },
		func(p *boxpolicy.Plan) { p.Tmpfs[2].Size = 0 },
	} {
		p := testPlan()
		bad(p)
		if got := ParseCmdline("kiln.plan=" + encodePlan(p)).Plan; got != nil {
			t.Errorf("the guest takes the plan %+v", got)
		}
	}
	if ParseCmdline("kiln.plan="+encodePlan(testPlan())).Plan == nil {
		t.Error("the guest refuses the plan every host sends")
	}
}

// TestMounts pins the security-relevant properties of the mount table:
// the box's filesystems are the plan's, capped as it caps them (the
// /dev/shm inode cap included), and its /proc masks are read-only.
func TestMounts(t *testing.T) {
	seen := map[string]mount{}
	for _, m := range mounts(testPlan()) {
		seen[m.target] = m
		if m.flags&msNosuid == 0 {
			t.Errorf("%s is mounted without nosuid", m.target)
		}
	}
	for target, want := range map[string]string{
		"/work":    "size=1048576,nr_inodes=10,uid=1000,gid=1000",
		"/tmp":     "size=2097152,nr_inodes=10",
		"/dev/shm": "size=67108864,nr_inodes=1024",
		"/proc":    "hidepid=2",
	} {
		if !strings.Contains(seen[target].data, want) {
			t.Errorf("%s mounted with %q, want it to contain %q", target, seen[target].data, want)
		}
	}
	for _, name := range boxpolicy.ProcMasks {
		m, ok := seen["/proc/"+name]
		switch {
		case !ok || m.flags&msBind == 0:
			t.Errorf("/proc/%s is not masked: %+v", name, m)
		case slices.Contains(boxpolicy.ProcReadOnly, name):
			if m.source != m.target || m.flags&msRdonly == 0 {
				t.Errorf("/proc/%s is not bound read-only onto itself (a write must fail): %+v", name, m)
			}
		case m.source != "/dev/null" || m.flags&msNodev != 0:
			t.Errorf("/proc/%s is not masked with a usable /dev/null: %+v", name, m)
		}
	}
	if seen["/sys"].flags&msRdonly == 0 {
		t.Error("/sys is writable")
	}
	order := map[string]int{}
	for i, m := range mounts(testPlan()) {
		order[m.target] = i
	}
	if order["/dev/shm"] < order["/dev"] || order["/proc/kcore"] < order["/proc"] {
		t.Error("a mount comes before the one it sits on")
	}
}

// TestCodeCgroupFiles: the code cgroup's pids limit is the plan's
// RLIMIT_NPROC, its memory the command line's, without swap.
func TestCodeCgroupFiles(t *testing.T) {
	p := defaults
	p.Plan, p.MemoryBytes = testPlan(), 4096
	got := map[string]string{}
	for _, f := range codeCgroupFiles(p) {
		got[f.file] = f.value
	}
	if d := cmp.Diff(map[string]string{"memory.max": "4096", "memory.swap.max": "0", "pids.max": "64"}, got); d != "" {
		t.Errorf("code cgroup (-want +got):\n%s", d)
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
	base.Plan, base.MemoryBytes = testPlan(), 5<<30
	base.Transport, base.VsockPort = "vsock", 1<<32-1
	cases := []Params{base}
	for _, h := range hostile {
		p := base
		p.Port = h
		cases = append(cases, p)
		// A plan's strings travel inside its encoding, whatever they hold.
		plan := *testPlan()
		plan.Env = append(plan.Env, "X="+h)
		p.Plan = &plan
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
		func(p *Params) { p.Plan = nil },
		func(p *Params) { p.Plan = &boxpolicy.Plan{Hostname: "a b", Workspace: "/work"} },
		func(p *Params) { p.Transport = "tcp" },
		func(p *Params) { p.MemoryBytes = 0 },
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
