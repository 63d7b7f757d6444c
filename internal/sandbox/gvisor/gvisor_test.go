package gvisor

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
)

// TestPinMatchesGoMod: the runsc kiln builds is the one go.mod pins.
func TestPinMatchesGoMod(t *testing.T) {
	b, err := os.ReadFile("../../../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*gvisor\.dev/gvisor (\S+)`).FindSubmatch(b)
	if m == nil {
		t.Fatal("go.mod does not require gvisor.dev/gvisor")
	}
	if got := string(m[1]); got != RunscVersion {
		t.Errorf("go.mod pins gvisor %s, RunscVersion is %s", got, RunscVersion)
	}
	if !regexp.MustCompile(`(?m)^tool gvisor\.dev/gvisor/runsc$|^\s+gvisor\.dev/gvisor/runsc$`).Match(b) {
		t.Errorf("go.mod has no tool directive for %s", runscPackage)
	}
}

func TestCheckStatic(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("builds linux test binaries")
	}
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command")
	}
	src := filepath.Join(t.TempDir(), "main.go")
	os.WriteFile(src, []byte("package main\nimport \"net\"\nfunc main() { net.Dial(\"tcp\", \"x\") }\n"), 0o644)
	for _, tc := range []struct {
		cgo     string
		dynamic bool
	}{{"0", false}, {"1", true}} {
		out := filepath.Join(t.TempDir(), "bin")
		cmd := exec.Command("go", "build", "-o", out, src)
		cmd.Env = append(os.Environ(), "CGO_ENABLED="+tc.cgo, "GOFLAGS=")
		if b, err := cmd.CombinedOutput(); err != nil {
			if tc.cgo == "1" {
				t.Logf("no cgo build here (%v); skipping the dynamic case", err)
				continue
			}
			t.Fatalf("go build: %v\n%s", err, b)
		}
		err := CheckStatic(out)
		if got := errors.Is(err, ErrDynamicRunsc); got != tc.dynamic {
			t.Errorf("CGO_ENABLED=%s: CheckStatic = %v, want dynamic=%v", tc.cgo, err, tc.dynamic)
		}
	}
	if err := CheckStatic("gvisor_test.go"); err == nil || errors.Is(err, ErrDynamicRunsc) {
		t.Errorf("CheckStatic of a non-ELF file = %v, want a read error", err)
	}
}

func testSpec() *specs.Spec {
	return buildSpec(boxConfig{
		Root:       "/state/rootfs",
		Agent:      "/opt/kiln-agent",
		HostDirs:   []hostDir{{"/usr"}},
		Limits:     sandbox.Limits{CPUs: 0.5}.WithDefaults(),
		Preload:    []string{"numpy", "pandas"},
		UID:        65534,
		GID:        65534,
		CgroupPath: "/kiln-gvisor/kiln-x",
	})
}

// TestSpecPolicy checks the security policy of a box's OCI spec.
func TestSpecPolicy(t *testing.T) {
	s := testSpec()
	l := sandbox.DefaultLimits
	p := s.Process
	// The agent is root of the box, with only what it needs to start code
	// as the box's user and serve files; code gets no capability.
	if p.User.UID != 0 || p.User.GID != 0 || len(p.User.AdditionalGids) != 0 || !p.NoNewPrivileges || p.Terminal {
		t.Errorf("process: %+v", p)
	}
	wantCaps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"}
	c := p.Capabilities
	if c == nil || !slices.Equal(c.Bounding, wantCaps) || !slices.Equal(c.Effective, wantCaps) || !slices.Equal(c.Permitted, wantCaps) ||
		len(c.Inheritable)+len(c.Ambient) != 0 {
		t.Errorf("capabilities: %+v, want %v and no inheritable or ambient ones", c, wantCaps)
	}
	if !s.Root.Readonly {
		t.Error("root is writable")
	}
	env := map[string]string{}
	for _, e := range p.Env {
		k, v, _ := strings.Cut(e, "=")
		env[k] = v
		if h := os.Getenv("HOME"); h != "" && h != "/" && strings.Contains(e, h) && !strings.HasPrefix(e, "HOME=") {
			t.Errorf("host environment leaks: %s", e)
		}
	}
	for _, k := range []string{"HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR", "TMPDIR"} {
		if v := env[k]; v != "/tmp" && !strings.HasPrefix(v, "/tmp/") {
			t.Errorf("%s=%q, want a box-private directory under /tmp, outside the workspace", k, v)
		}
	}
	if want := []string{boxpolicy.AgentPath, "-workspace=/work", "-preload=numpy,pandas", "-uid=65534", "-gid=65534"}; !slices.Equal(p.Args, want) {
		t.Errorf("args %q, want %q", p.Args, want)
	}
	var ns []specs.LinuxNamespaceType
	for _, n := range s.Linux.Namespaces {
		ns = append(ns, n.Type)
	}
	for _, want := range []specs.LinuxNamespaceType{specs.PIDNamespace, specs.NetworkNamespace, specs.IPCNamespace, specs.UTSNamespace, specs.MountNamespace} {
		if !slices.Contains(ns, want) {
			t.Errorf("no %s namespace", want)
		}
	}
	r := s.Linux.Resources
	if *r.Memory.Limit != l.MemoryBytes+sentryMemSlack || r.Pids.Limit != int64(l.Pids)+hostPidsSlack || *r.CPU.Quota != 50000 || *r.CPU.Period != 100000 {
		t.Errorf("resources: mem %d pids %d cpu %d/%d", *r.Memory.Limit, r.Pids.Limit, *r.CPU.Quota, *r.CPU.Period)
	}
	rl := map[string]uint64{}
	for _, x := range p.Rlimits {
		rl[x.Type] = x.Hard
	}
	if rl["RLIMIT_NPROC"] != uint64(l.Pids) || rl["RLIMIT_NOFILE"] != uint64(l.OpenFiles) {
		t.Errorf("rlimits: %v", rl)
	}
	mounts := map[string]specs.Mount{}
	for _, m := range s.Mounts {
		mounts[m.Destination] = m
	}
	for _, d := range []string{"/usr", boxpolicy.AgentPath} {
		if m := mounts[d]; m.Type != "bind" || !slices.Contains(m.Options, "ro") {
			t.Errorf("%s: %+v, want a read-only bind", d, m)
		}
	}
	for d, size := range map[string]int64{"/work": l.WorkspaceBytes, "/tmp": l.TmpBytes} {
		m := mounts[d]
		if m.Type != "tmpfs" || !slices.Contains(m.Options, "size="+strconv.FormatInt(size, 10)) {
			t.Errorf("%s: %+v, want a tmpfs of %d bytes", d, m, size)
		}
	}
	for _, m := range s.Mounts {
		if m.Type == "bind" && m.Source != "/usr" && m.Source != "/opt/kiln-agent" {
			t.Errorf("unexpected host bind %+v", m)
		}
	}
	seccompPolicy(t, s.Linux.Seccomp)
}

// seccompPolicy checks that the box's OCI seccomp section is the shared
// syscall policy, rule for rule, in the forms runsc understands: ENOSYS (a
// trace action with no tracer) by default and for absent syscalls, EPERM
// for denied ones, and masked compares for argument checks.
func seccompPolicy(t *testing.T, sc *specs.LinuxSeccomp) {
	t.Helper()
	if sc == nil || sc.DefaultAction != specs.ActTrace {
		t.Fatalf("seccomp: %+v, want default trace (ENOSYS) with rules", sc)
	}
	if len(sc.Syscalls) != len(boxpolicy.SyscallPolicy) {
		t.Fatalf("%d rules, want the policy's %d", len(sc.Syscalls), len(boxpolicy.SyscallPolicy))
	}
	want := map[boxpolicy.SyscallAction]specs.LinuxSeccompAction{boxpolicy.Allow: specs.ActAllow, boxpolicy.Deny: specs.ActErrno, boxpolicy.Absent: specs.ActTrace}
	for i, r := range sc.Syscalls {
		p := boxpolicy.SyscallPolicy[i]
		if !slices.Equal(r.Names, p.Names) || r.Action != want[p.Action] || len(r.Args) != len(p.Args) {
			t.Errorf("rule %d: %+v, want %+v", i, r, p)
			continue
		}
		if r.Action == specs.ActErrno && (r.ErrnoRet == nil || *r.ErrnoRet != uint(syscall.EPERM)) {
			t.Errorf("rule %d: errno %v, want EPERM", i, r.ErrnoRet)
		}
		seen := map[uint]bool{}
		for j, a := range r.Args {
			c := p.Args[j]
			if a.Op != specs.OpMaskedEqual || a.Index != c.Index || a.Value != c.Mask || a.ValueTwo != c.Value || seen[a.Index] {
				// runsc reads two checks on one argument as alternatives.
				t.Errorf("rule %d %v: argument check %+v, want %+v", i, r.Names, a, c)
			}
			seen[a.Index] = true
		}
	}
}

func TestTemplateKey(t *testing.T) {
	a, b := testSpec(), testSpec()
	b.Root.Path = "/elsewhere"
	b.Linux.CgroupsPath = "/kiln-gvisor/other"
	*b.Linux.Resources.Memory.Limit *= 2
	if templateKey(a) != templateKey(b) {
		t.Error("boxes that differ only where runsc allows a restore to differ get different templates")
	}
	c := testSpec()
	c.Process.Args = append(c.Process.Args[:2:2], "-preload=numpy")
	d := testSpec()
	d.Mounts[len(d.Mounts)-1].Options = []string{"size=1"}
	for _, other := range []*specs.Spec{c, d} {
		if templateKey(a) == templateKey(other) {
			t.Error("boxes of different shapes share a template")
		}
	}
	if templateKey(a, "v1") == templateKey(a, "v2") {
		t.Error("the runsc version does not change the template")
	}
}

func TestContainerID(t *testing.T) {
	ok := regexp.MustCompile(`^[\w+\.-]+$`)
	for _, id := range []string{"s1", "../../etc", "a b", "ü", "x/y"} {
		if got := containerID(id); !ok.MatchString(got) || strings.Contains(got, "/") {
			t.Errorf("containerID(%q) = %q", id, got)
		}
	}
}

// TestEnsureRunsc builds (or finds) the pinned runsc and checks it is static
// and says its version. It is also how CI and make build runsc:
//
//	KILN_TEST_GVISOR=1 go test ./internal/sandbox/gvisor -run TestEnsureRunsc
func TestEnsureRunsc(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("runsc runs on Linux only")
	}
	path, err := CachedRunscPath()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil && os.Getenv("KILN_TEST_GVISOR") != "1" {
		t.Skip("no cached runsc; set KILN_TEST_GVISOR=1 to build it (about a minute)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	got, err := EnsureRunsc(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got != path {
		t.Errorf("EnsureRunsc = %s, want %s", got, path)
	}
	if err := CheckStatic(got); err != nil {
		t.Error(err)
	}
	if v, err := runscVersion(ctx, got); err != nil || v != RunscVersion {
		t.Errorf("runsc --version = %q, %v; want %s", v, err, RunscVersion)
	}
}
