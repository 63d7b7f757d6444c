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
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

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
	if p.User.UID == 0 || p.User.GID == 0 || !p.NoNewPrivileges || p.Terminal {
		t.Errorf("process: %+v", p)
	}
	c := p.Capabilities
	if c == nil || len(c.Bounding)+len(c.Effective)+len(c.Permitted)+len(c.Inheritable)+len(c.Ambient) != 0 {
		t.Errorf("capabilities: %+v", c)
	}
	if !s.Root.Readonly {
		t.Error("root is writable")
	}
	for _, e := range p.Env {
		if strings.Contains(e, os.Getenv("HOME")) && os.Getenv("HOME") != "" && !strings.HasPrefix(e, "HOME=/work") {
			t.Errorf("host environment leaks: %s", e)
		}
	}
	if want := []string{agentPath, "-workspace=/work", "-preload=numpy,pandas"}; !slices.Equal(p.Args, want) {
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
	for _, d := range []string{"/usr", agentPath} {
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

// seccompPolicy checks that the box's OCI seccomp section carries the
// shared syscall policy in the forms runsc understands: EPERM for the
// denied names, clone with a namespace flag and AF_PACKET sockets; ENOSYS
// (a trace action with no tracer) for clone3.
func seccompPolicy(t *testing.T, sc *specs.LinuxSeccomp) {
	t.Helper()
	if sc == nil || sc.DefaultAction != specs.ActAllow {
		t.Fatalf("seccomp: %+v, want default allow with rules", sc)
	}
	action := map[string]specs.LinuxSeccompAction{}
	var cloneFlags []uint64
	for _, r := range sc.Syscalls {
		for _, n := range r.Names {
			switch {
			case n == "clone":
				if r.Action != specs.ActErrno || len(r.Args) != 1 || r.Args[0].Op != specs.OpMaskedEqual || r.Args[0].Value != r.Args[0].ValueTwo {
					t.Errorf("clone rule %+v", r)
				} else {
					cloneFlags = append(cloneFlags, r.Args[0].Value)
				}
			case n == "socket":
				if r.Action != specs.ActErrno || len(r.Args) != 1 || r.Args[0].Op != specs.OpEqualTo || r.Args[0].Value != sandbox.AFPacket {
					t.Errorf("socket rule %+v", r)
				}
			case len(r.Args) != 0:
				t.Errorf("%s: conditional rule %+v", n, r)
			default:
				action[n] = r.Action
			}
		}
	}
	for _, n := range sandbox.DeniedSyscalls {
		if action[n] != specs.ActErrno {
			t.Errorf("%s: %q, want %q", n, action[n], specs.ActErrno)
		}
	}
	for _, n := range sandbox.AbsentSyscalls {
		if action[n] != specs.ActTrace {
			t.Errorf("%s: %q, want %q (ENOSYS)", n, action[n], specs.ActTrace)
		}
	}
	if !slices.Equal(cloneFlags, sandbox.DeniedCloneFlags) {
		t.Errorf("clone flags refused %#x, want %#x", cloneFlags, sandbox.DeniedCloneFlags)
	}
}

// TestHostEtcHoldsNoSecrets: the host /etc entries a box sees are a fixed
// list, and none of them is a secret.
func TestHostEtcHoldsNoSecrets(t *testing.T) {
	for _, e := range hostEtc {
		for _, bad := range []string{"shadow", "gshadow", "sudoers", "ssh", "private", "passwd", "group", "."} {
			if strings.HasPrefix(e, bad) || e == "ssl" {
				t.Errorf("hostEtc holds %q", e)
			}
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
