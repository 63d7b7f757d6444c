package sandboxtest

import (
	"encoding/json"
	"fmt"
	"math"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"kiln/internal/boxpolicy"
)

// The box plan (internal/boxpolicy) checked in a live box: each of its
// tmpfs mounted where it says, nosuid and nodev, with its size, inode cap,
// mode and owner; each of its /proc masks in place; its rlimits on the
// code's process; the syscall policy in force; its hostname and its
// environment. Every expected value is read from boxpolicy.New and
// boxpolicy.SyscallPolicy, for the limits the suite gives the backend and
// the user code runs as in the box; where a backend carries out a part of
// the plan differently, an Options field says so and why.

func init() {
	cases = append(cases, testCase{"the live box matches its plan", planConforms})
}

// planProbe runs as code in the box and prints, as JSON, what the checks
// read: the mount table, the code's limits and seccomp mode, stat and
// statvfs of each of the plan's tmpfs, each /proc mask, the host name, the
// environment, and what each syscall probe answered. Its input is the
// paths, names and syscall numbers to look at, never the expected values.
const planProbe = `import errno, json, os, stat
cfg = json.loads(%s)
def read(p, n=1 << 20):
    try:
        with open(p, "rb") as f:
            return {"data": f.read(n).decode("utf-8", "replace")}
    except OSError as e:
        return {"errno": errno.errorcode.get(e.errno, str(e.errno))}
out = {"uid": os.getuid(), "gid": os.getgid(), "nodename": os.uname().nodename if hasattr(os, "uname") else None, "env": dict(os.environ)}
for k, p in (("mountinfo", "/proc/self/mountinfo"), ("limits", "/proc/self/limits"), ("status", "/proc/self/status"), ("etc_hostname", "/etc/hostname")):
    out[k] = read(p)
out["tmpfs"] = {}
for p in cfg["tmpfs"]:
    d = {}
    try:
        st = os.stat(p)
        d.update(uid=st.st_uid, gid=st.st_gid, mode=stat.S_IMODE(st.st_mode))
        v = os.statvfs(p)
        d.update(bsize=v.f_bsize, blocks=v.f_blocks, files=v.f_files)
    except (OSError, AttributeError) as e:
        d["error"] = repr(e)
    out["tmpfs"][p] = d
out["masks"] = {}
try:
    out["devnull"] = os.stat("/dev/null").st_rdev
except OSError:
    out["devnull"] = -1
for m in cfg["masks"]:
    p = "/proc/" + m
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        out["masks"][m] = {"absent": True}
        continue
    except OSError as e:
        out["masks"][m] = {"lstat_errno": errno.errorcode.get(e.errno, str(e.errno))}
        continue
    d = {"mode": st.st_mode, "chr": stat.S_ISCHR(st.st_mode), "rdev": st.st_rdev}
    d.update(read(p, 4096))
    out["masks"][m] = d
if cfg["os"]:
    import ctypes, resource
    out["getrlimit"] = {n: list(resource.getrlimit(getattr(resource, n))) if hasattr(resource, n) else None for n in cfg["rlimits"]}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out["probes"] = {}
    for name, nr, args in cfg["probes"]:
        args = [ctypes.c_long(os.getpid() if a == "pid" else a) for a in args]
        ctypes.set_errno(0)
        r = libc.syscall(ctypes.c_long(nr), *args)
        out["probes"][name] = "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
print(json.dumps(out))
`

// planProbeNoOS is what planProbe prints that a box without an operating
// system (Options.NoOS) has: its environment. (os.getuid kills a wasm box.)
const planProbeNoOS = `import json, os
print(json.dumps({"uid": -1, "gid": -1, "env": dict(os.environ)}))
`

// planReading is what planProbe prints.
type planReading struct {
	UID, GID  int
	Nodename  *string
	Env       map[string]string
	Mountinfo fileReading
	Limits    fileReading
	Status    fileReading
	EtcHost   fileReading `json:"etc_hostname"`
	Tmpfs     map[string]struct {
		UID, GID, Mode       int
		Bsize, Blocks, Files uint64
		Error                string
	}
	Devnull   int64
	Masks     map[string]maskReading
	Getrlimit map[string][]int64
	Probes    map[string]string
}

type fileReading struct {
	Data  *string
	Errno string
}

func (f fileReading) String() string {
	if f.Data == nil {
		return "unreadable (" + f.Errno + ")"
	}
	return strconv.Quote(*f.Data)
}

type maskReading struct {
	Absent     bool
	LstatErrno string `json:"lstat_errno"`
	Errno      string // of the read
	Mode       uint32
	Chr        bool
	Rdev       int64
	Data       *string
}

func (m maskReading) String() string {
	switch {
	case m.Absent:
		return "absent"
	case m.LstatErrno != "":
		return "lstat: " + m.LstatErrno
	}
	read := "unreadable (" + m.Errno + ")"
	if m.Data != nil {
		read = fmt.Sprintf("%d bytes read", len(*m.Data))
	}
	return fmt.Sprintf("mode %o, rdev %#x, %s", m.Mode, m.Rdev, read)
}

// strOrNil quotes *p, or says there is none.
func strOrNil(p *string) string {
	if p == nil {
		return "(none)"
	}
	return strconv.Quote(*p)
}

// planSyscall is one call planProbe makes: its name in the policy and its
// arguments ("pid": the caller's pid). Each one is harmless, and where no
// filter stands in its way it succeeds or fails with an errno other than
// the policy's (kcmp of the caller with itself: 0; clone3 with no
// arguments: EINVAL; io_destroy of no context: EINVAL), so the answer says
// whether the policy decided it.
type planSyscall struct {
	name string
	args []any
}

var planSyscalls = []planSyscall{
	{"getpid", nil},
	{"kcmp", []any{"pid", "pid", 1, 0, 0}}, // KCMP_VM
	{"clone3", []any{0, 0}},
	{"io_destroy", []any{0}},
}

// policyOutcome is what the syscall policy makes of a call with no
// argument: "ok", "EPERM" or "ENOSYS".
func policyOutcome(name string) string {
	action, ok := boxpolicy.PolicyAction(boxpolicy.SyscallPolicy, name, nil)
	switch {
	case !ok || action == boxpolicy.Absent:
		return "ENOSYS"
	case action == boxpolicy.Deny:
		return "EPERM"
	}
	return "ok"
}

// probeConfig is planProbe's input for plan p.
func (s *suite) probeConfig(p boxpolicy.Plan) string {
	cfg := map[string]any{"os": s.opts.NoOS == "", "tmpfs": []string{}, "masks": p.ProcMasks, "rlimits": []string{}}
	for _, t := range p.Tmpfs {
		cfg["tmpfs"] = append(cfg["tmpfs"].([]string), t.Path)
	}
	for _, r := range p.Rlimits {
		cfg["rlimits"] = append(cfg["rlimits"].([]string), r.Name)
	}
	cfg["probes"] = probeList()
	b, _ := json.Marshal(cfg)
	return strconv.Quote(string(b))
}

// probeList is planSyscalls as planProbe reads them: name, number on
// this architecture, arguments.
func probeList() [][]any {
	out := [][]any{}
	for _, pr := range planSyscalls {
		if nr, ok := syscallNumbers[pr.name]; ok {
			out = append(out, []any{pr.name, nr, append([]any{}, pr.args...)})
		}
	}
	return out
}

// hostProbeAnswers runs the syscall probes in a plain python3 on the host,
// outside any box and filter: a probe whose answer there is already the
// policy's cannot tell, in a box on the host's kernel, the policy's
// refusal from the kernel's.
var hostProbeAnswers = sync.OnceValues(func() (map[string]string, error) {
	cfg := map[string]any{"os": true, "tmpfs": []string{}, "masks": []string{}, "rlimits": []string{}, "probes": probeList()}
	b, _ := json.Marshal(cfg)
	out, err := exec.Command("python3", "-c", fmt.Sprintf(planProbe, strconv.Quote(string(b)))).Output()
	if err != nil {
		return nil, err
	}
	var r planReading
	if err := json.Unmarshal(out, &r); err != nil {
		return nil, err
	}
	return r.Probes, nil
})

// expectedPlan is the plan of the suite's boxes: the backend gets
// s.opts.Limits (filled in with sandbox.DefaultLimits, as every backend
// does) and mounts the workspace for the user code runs as.
func (s *suite) expectedPlan(uid, gid int) boxpolicy.Plan {
	l := s.opts.Limits.WithDefaults()
	return boxpolicy.New(boxpolicy.Limits{
		WorkspaceBytes: l.WorkspaceBytes,
		TmpBytes:       l.TmpBytes,
		Inodes:         l.Inodes,
		Pids:           l.Pids,
		OpenFiles:      l.OpenFiles,
	}, uid, gid)
}

func planConforms(t *testing.T, s *suite) {
	box := s.box(t)
	// What the probe looks at does not depend on the owner of the
	// workspace, which is the user code runs as: the backend's to choose
	// (boxpolicy.UID, nobody, a uid of the box's own). The plan to hold
	// the box to is made for the user the probe ran as.
	probe := fmt.Sprintf(planProbe, s.probeConfig(s.expectedPlan(-1, -1)))
	if s.opts.NoOS != "" {
		// Only the environment is asked of a box with no operating
		// system.
		probe = planProbeNoOS
	}
	r := pyOK(t, s, box, probe)
	var got planReading
	if err := json.Unmarshal([]byte(r.Stdout.Text), &got); err != nil {
		t.Fatalf("the probe's output: %v\n%s", err, r.out)
	}
	plan := s.expectedPlan(got.UID, got.GID)
	t.Logf("code runs as %d:%d; the plan: %+v", got.UID, got.GID, plan)
	if s.opts.PlanUnverified != "" {
		t.Logf("the box's reading: %s", r.Stdout.Text)
		t.Skipf("the plan's checks are not yet verified on this backend: %s", s.opts.PlanUnverified)
	}

	t.Run("mounts", func(t *testing.T) {
		s.needOS(t)
		checkMounts(t, s, plan, &got)
	})
	t.Run("masks", func(t *testing.T) {
		s.needOS(t)
		checkMasks(t, s, plan, &got)
	})
	t.Run("rlimits", func(t *testing.T) {
		s.needOS(t)
		checkRlimits(t, plan, &got)
	})
	t.Run("seccomp", func(t *testing.T) {
		s.needOS(t)
		checkSyscallPolicy(t, s, &got)
	})
	t.Run("hostname", func(t *testing.T) {
		s.needOS(t)
		if got.Nodename == nil || *got.Nodename != plan.Hostname {
			t.Errorf("the box's host name is %v, the plan's %q", strOrNil(got.Nodename), plan.Hostname)
		}
		if want := boxpolicy.Etc(plan.Hostname, "", got.UID, got.GID)["hostname"]; got.EtcHost.Data == nil || *got.EtcHost.Data != want {
			t.Errorf("/etc/hostname is %s, want %q", got.EtcHost, want)
		}
	})
	t.Run("env", func(t *testing.T) {
		report := t.Errorf
		if s.opts.NoPlanEnv != "" {
			report = t.Logf
		}
		for _, kv := range slices.Concat(plan.Env, boxpolicy.UserEnv(got.UID)) {
			k, v, _ := strings.Cut(kv, "=")
			if have, ok := got.Env[k]; !ok || have != v {
				report("code's environment has %s=%q (set: %v), the plan's is %q", k, have, ok, v)
			}
		}
		if s.opts.NoPlanEnv != "" {
			t.Skipf("the plan's environment is not asked of this backend: %s", s.opts.NoPlanEnv)
		}
	})
}

// mountEntry is one line of /proc/self/mountinfo.
type mountEntry struct {
	point, fstype string
	opts, super   []string // per-mount and superblock options
}

// parseMountinfo reads /proc/self/mountinfo (proc(5)).
func parseMountinfo(s string) ([]mountEntry, error) {
	var out []mountEntry
	for _, line := range strings.Split(strings.TrimSpace(s), "\n") {
		f := strings.Fields(line)
		sep := slices.Index(f, "-")
		if sep < 6 || len(f) < sep+4 {
			return nil, fmt.Errorf("mountinfo line %q", line)
		}
		out = append(out, mountEntry{
			point:  unescapeMount(f[4]),
			fstype: f[sep+1],
			opts:   strings.Split(f[5], ","),
			super:  strings.Split(f[sep+3], ","),
		})
	}
	return out, nil
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// option is the value of key=value in opts, and whether it is there.
func option(opts []string, key string) (string, bool) {
	for _, o := range opts {
		if k, v, ok := strings.Cut(o, "="); ok && k == key {
			return v, true
		}
	}
	return "", false
}

// topMount is the last (uppermost) mount at point.
func topMount(mounts []mountEntry, point string) (mountEntry, bool) {
	for i := len(mounts) - 1; i >= 0; i-- {
		if mounts[i].point == point {
			return mounts[i], true
		}
	}
	return mountEntry{}, false
}

// checkMounts: each of the plan's tmpfs is the uppermost mount at its
// path, a tmpfs mounted nosuid and nodev, of the plan's size (rounded up to
// whole pages, as tmpfs does) and inode cap, whose root has the plan's
// mode and owner (the mounter, root of the box, where the plan names
// none).
func checkMounts(t *testing.T, s *suite, plan boxpolicy.Plan, got *planReading) {
	if got.Mountinfo.Data == nil {
		t.Fatalf("/proc/self/mountinfo is %s", got.Mountinfo)
	}
	mounts, err := parseMountinfo(*got.Mountinfo.Data)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range plan.Tmpfs {
		t.Run(want.Path, func(t *testing.T) {
			m, ok := topMount(mounts, want.Path)
			if !ok {
				t.Fatalf("nothing is mounted at %s:\n%s", want.Path, *got.Mountinfo.Data)
			}
			t.Logf("%s: %s %v %v", want.Path, m.fstype, m.opts, m.super)
			if m.fstype != "tmpfs" {
				t.Errorf("%s is %s, the plan's is tmpfs", want.Path, m.fstype)
			}
			for _, o := range []string{"nosuid", "nodev"} {
				switch {
				case slices.Contains(m.opts, o):
				case o == "nodev" && s.opts.NoNodev != "":
					t.Logf("%s is mounted without nodev, which is not asked of this backend: %s", want.Path, s.opts.NoNodev)
				case s.opts.PlatformTmpfs != "":
					t.Logf("%s is mounted without %s, which is not asked of this backend: %s", want.Path, o, s.opts.PlatformTmpfs)
				default:
					t.Errorf("%s is mounted without %s: %v", want.Path, o, m.opts)
				}
			}
			st := got.Tmpfs[want.Path]
			if st.Error != "" {
				t.Fatalf("stat %s: %s", want.Path, st.Error)
			}
			page := max(st.Bsize, 1)
			wantBlocks := (uint64(want.Size) + page - 1) / page
			if sz, ok := option(m.super, "size"); !ok || sz != strconv.FormatUint(wantBlocks*page/1024, 10)+"k" {
				t.Errorf("%s has size %q in mountinfo (set: %v), the plan's %d bytes are %dk", want.Path, sz, ok, want.Size, wantBlocks*page/1024)
			}
			if st.Blocks != wantBlocks {
				t.Errorf("%s has %d blocks of %d bytes, the plan's %d bytes are %d", want.Path, st.Blocks, page, want.Size, wantBlocks)
			}
			if want.Inodes > 0 {
				n, ok := option(m.super, "nr_inodes")
				switch {
				case s.opts.NoInodeCap != "":
					t.Logf("%s has nr_inodes %q (set: %v); the plan's %d is not asked of this backend: %s", want.Path, n, ok, want.Inodes, s.opts.NoInodeCap)
				case !ok || n != strconv.Itoa(want.Inodes):
					t.Errorf("%s has nr_inodes %q in mountinfo (set: %v), the plan's is %d", want.Path, n, ok, want.Inodes)
				case st.Files != uint64(want.Inodes):
					t.Errorf("%s has %d inodes, the plan's is %d", want.Path, st.Files, want.Inodes)
				}
			}
			if s.opts.PlatformTmpfs != "" {
				t.Logf("%s has mode %o and owner %d:%d (the plan's: %s, %d:%d), which are not asked of this backend: %s", want.Path, st.Mode, st.UID, st.GID, want.Mode, want.UID, want.GID, s.opts.PlatformTmpfs)
				return
			}
			if mode, err := strconv.ParseUint(want.Mode, 8, 32); err != nil || st.Mode != int(mode) {
				t.Errorf("%s has mode %o, the plan's is %s", want.Path, st.Mode, want.Mode)
			}
			uid, gid := want.UID, want.GID
			if uid < 0 {
				uid, gid = 0, 0 // the mounter: root of the box
			}
			if st.UID != uid || st.GID != gid {
				t.Errorf("%s belongs to %d:%d, the plan's owner is %d:%d", want.Path, st.UID, st.GID, uid, gid)
			}
		})
	}
}

// checkMasks: each of the plan's /proc masks is /dev/null; or, where the
// backend binds the file read-only onto itself so that a write fails
// rather than vanishes (the jail's /proc/sysrq-trigger), a file without
// read permission on a read-only mount. A file the box's kernel does not
// have needs no mask.
func checkMasks(t *testing.T, s *suite, plan boxpolicy.Plan, got *planReading) {
	var mounts []mountEntry
	if got.Mountinfo.Data != nil {
		mounts, _ = parseMountinfo(*got.Mountinfo.Data)
	}
	if len(plan.ProcMasks) == 0 {
		t.Fatal("the plan masks nothing under /proc")
	}
	if s.opts.NoProcMasks != "" {
		for _, name := range plan.ProcMasks {
			top, mounted := topMount(mounts, "/proc/"+name)
			t.Logf("/proc/%s: %v, a mount over it: %v %v", name, got.Masks[name], mounted, top.opts)
		}
		t.Skipf("the plan's /proc masks are not asked of this backend: %s", s.opts.NoProcMasks)
	}
	for _, name := range plan.ProcMasks {
		m, ok := got.Masks[name]
		if !ok {
			t.Errorf("the probe did not look at /proc/%s", name)
			continue
		}
		if how, masked := maskState("/proc/"+name, m, mounts, got.Devnull); masked {
			t.Logf("/proc/%s: %s", name, how)
		} else {
			t.Errorf("/proc/%s is not masked: %s", name, how)
		}
	}
}

// maskState says how the file at p, as the probe saw it (m), is masked,
// or why it is not.
func maskState(p string, m maskReading, mounts []mountEntry, devnull int64) (string, bool) {
	top, mounted := topMount(mounts, p)
	switch {
	case m.Absent:
		return "absent from the box's /proc, nothing to mask", true
	case m.LstatErrno != "":
		return "lstat failed with " + m.LstatErrno, false
	case m.Chr && devnull >= 0 && m.Rdev == devnull:
		if m.Data != nil && *m.Data != "" {
			return fmt.Sprintf("/dev/null, but %d bytes read", len(*m.Data)), false
		}
		return "/dev/null", true
	case mounted && slices.Contains(top.opts, "ro") && m.Mode&0o444 == 0 && (m.Data == nil || *m.Data == ""):
		return fmt.Sprintf("bound read-only, mode %o: nothing can be written to it, nor read by code", m.Mode&0o7777), true
	}
	return fmt.Sprintf("%v (/dev/null's rdev is %#x), a mount over it: %v %v", m, devnull, mounted, top.opts), false
}

// limitNames are /proc/self/limits' names of the rlimits (fs/proc/base.c).
var limitNames = map[string]string{
	"RLIMIT_CPU": "Max cpu time", "RLIMIT_FSIZE": "Max file size", "RLIMIT_DATA": "Max data size",
	"RLIMIT_STACK": "Max stack size", "RLIMIT_CORE": "Max core file size", "RLIMIT_RSS": "Max resident set",
	"RLIMIT_NPROC": "Max processes", "RLIMIT_NOFILE": "Max open files", "RLIMIT_MEMLOCK": "Max locked memory",
	"RLIMIT_AS": "Max address space", "RLIMIT_LOCKS": "Max file locks", "RLIMIT_SIGPENDING": "Max pending signals",
	"RLIMIT_MSGQUEUE": "Max msgqueue size", "RLIMIT_NICE": "Max nice priority", "RLIMIT_RTPRIO": "Max realtime priority",
	"RLIMIT_RTTIME": "Max realtime timeout",
}

// parseLimits reads /proc/self/limits: name -> soft and hard limit
// (math.MaxUint64 for unlimited).
func parseLimits(s string) (map[string][2]uint64, error) {
	out := map[string][2]uint64{}
	for _, line := range strings.Split(s, "\n")[1:] {
		for rl, name := range limitNames {
			rest, ok := strings.CutPrefix(line, name+" ")
			if !ok {
				continue
			}
			f := strings.Fields(rest)
			if len(f) < 2 {
				return nil, fmt.Errorf("limits line %q", line)
			}
			var v [2]uint64
			for i := range v {
				if f[i] == "unlimited" {
					v[i] = math.MaxUint64
					continue
				}
				n, err := strconv.ParseUint(f[i], 10, 64)
				if err != nil {
					return nil, fmt.Errorf("limits line %q: %w", line, err)
				}
				v[i] = n
			}
			out[rl] = v
		}
	}
	return out, nil
}

// checkRlimits: code's soft and hard limits are the plan's, in
// /proc/self/limits and through getrlimit.
func checkRlimits(t *testing.T, plan boxpolicy.Plan, got *planReading) {
	if got.Limits.Data == nil {
		t.Fatalf("/proc/self/limits is %s", got.Limits)
	}
	limits, err := parseLimits(*got.Limits.Data)
	if err != nil {
		t.Fatal(err)
	}
	if len(plan.Rlimits) == 0 {
		t.Fatal("the plan sets no rlimit")
	}
	for _, want := range plan.Rlimits {
		if _, ok := limitNames[want.Name]; !ok {
			t.Errorf("the plan's %s has no name in /proc/self/limits known to this check", want.Name)
			continue
		}
		have, ok := limits[want.Name]
		if !ok {
			t.Errorf("/proc/self/limits has no %q line:\n%s", limitNames[want.Name], *got.Limits.Data)
		} else if have != [2]uint64{want.Value, want.Value} {
			t.Errorf("%s is %d (soft), %d (hard) in /proc/self/limits, the plan's %d", want.Name, have[0], have[1], want.Value)
		}
		if g := got.Getrlimit[want.Name]; len(g) != 2 || g[0] != int64(want.Value) || g[1] != int64(want.Value) {
			t.Errorf("getrlimit(%s) is %v, the plan's %d", want.Name, g, want.Value)
		}
	}
}

// statusField is the value of a "Name:\tvalue" line of /proc/self/status.
func statusField(status, name string) (string, bool) {
	for _, line := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			return strings.TrimSpace(v), true
		}
	}
	return "", false
}

// checkSyscallPolicy: code runs under a seccomp filter (mode 2), and each
// probe gets what boxpolicy.SyscallPolicy says: Allow runs, Deny fails
// with EPERM, Absent and what no rule names fail with ENOSYS. gVisor's
// kernel applies the policy itself, and reports the mode as Linux does.
func checkSyscallPolicy(t *testing.T, s *suite, got *planReading) {
	mode, modeOK := "", false
	if got.Status.Data != nil {
		mode, modeOK = statusField(*got.Status.Data, "Seccomp")
	}
	if s.opts.OwnKernel {
		t.Logf("Seccomp: %q (set: %v); syscall probes: %v", mode, modeOK, got.Probes)
		t.Skip("the box's code runs on a kernel of its own (Options.OwnKernel), not under kiln's syscall policy")
	}
	if !modeOK || mode != "2" {
		t.Errorf("Seccomp: %q in /proc/self/status (set: %v), want 2 (filter)", mode, modeOK)
	}
	if len(syscallNumbers) == 0 {
		t.Skipf("the probes' syscall numbers are known for linux only, not %s", runtime.GOOS)
	}
	var host map[string]string
	if s.opts.HostProcesses {
		var err error
		if host, err = hostProbeAnswers(); err != nil {
			t.Logf("the host control (the probes in a plain python3 on the host) could not run: %v", err)
		}
	}
	for _, pr := range planSyscalls {
		want, have := policyOutcome(pr.name), got.Probes[pr.name]
		switch {
		case s.opts.OtherSyscallPolicy != "":
			t.Logf("%s: %s (kiln's policy: %s; not asked of this backend: %s)", pr.name, have, want, s.opts.OtherSyscallPolicy)
		case have == want && want != "ok" && host != nil && host[pr.name] == want:
			t.Logf("%s: %s, as kiln's policy says, but the host's kernel answers that without a filter too", pr.name, have)
		case have != want:
			t.Errorf("%s answered %s in the box; kiln's syscall policy says %s", pr.name, have, want)
		default:
			t.Logf("%s: %s, as kiln's policy says (host: %s)", pr.name, have, host[pr.name])
		}
	}
}
