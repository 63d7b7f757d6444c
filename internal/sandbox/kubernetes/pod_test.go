package kubernetes

import (
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
)

func testPod(t *testing.T, edit func(*podConfig)) *corev1.Pod {
	t.Helper()
	c := podConfig{
		Name: "kiln-box-1-abcd", Namespace: "ns", BoxID: "box/1", Image: "reg:5000/kiln/box:1",
		PullPolicy: corev1.PullIfNotPresent, SeccompProfile: "kiln/box.json",
		Limits:  sandbox.Limits{MemoryBytes: 256 << 20, CPUs: 0.5}.WithDefaults(),
		Preload: []string{"numpy"}, Replica: "r1", UID: 1000000123, GID: 1000000123,
		Owner: &metav1.OwnerReference{APIVersion: "coordination.k8s.io/v1", Kind: "Lease", Name: "kiln-replica-r1", UID: "u1"},
	}
	if edit != nil {
		edit(&c)
	}
	return buildPod(c)
}

// TestPodHardening holds the Pod to the jail's container hardening, field
// by field: each is a line an operator's admission policy may check.
func TestPodHardening(t *testing.T) {
	p := testPod(t, nil)
	s := p.Spec
	if s.AutomountServiceAccountToken == nil || *s.AutomountServiceAccountToken {
		t.Error("the service-account token is mounted")
	}
	if s.EnableServiceLinks == nil || *s.EnableServiceLinks {
		t.Error("service links put the cluster's services in the box's environment")
	}
	if s.HostNetwork || s.HostPID || s.HostIPC {
		t.Error("a host namespace is shared")
	}
	if s.RestartPolicy != corev1.RestartPolicyNever {
		t.Errorf("restart policy %s: a box that dies must stay dead", s.RestartPolicy)
	}
	if len(s.Containers) != 1 || len(s.InitContainers) != 0 {
		t.Fatalf("want one container, got %d (+%d init)", len(s.Containers), len(s.InitContainers))
	}
	c := s.Containers[0]
	sc := c.SecurityContext
	// The agent runs as root with the few capabilities it needs to start
	// code as the box's own uid and to stop it; code runs as that uid.
	switch {
	case sc == nil:
		t.Fatal("no container securityContext")
	case sc.RunAsUser == nil || *sc.RunAsUser != 0 || sc.RunAsGroup == nil || *sc.RunAsGroup != 0:
		t.Error("the agent does not run as root: it could not start code as another uid")
	case sc.RunAsNonRoot != nil && *sc.RunAsNonRoot:
		t.Error("runAsNonRoot is set on a root agent")
	case sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
		t.Error("the root filesystem is writable")
	case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation:
		t.Error("privilege escalation is allowed")
	case sc.Privileged == nil || *sc.Privileged:
		t.Error("privileged")
	case sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL":
		t.Errorf("capabilities %+v, want drop ALL", sc.Capabilities)
	case !slices.Equal(sc.Capabilities.Add, []corev1.Capability{"KILL", "SETGID", "SETUID"}):
		t.Errorf("capabilities added %v, want KILL SETGID SETUID only", sc.Capabilities.Add)
	case sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeLocalhost || *sc.SeccompProfile.LocalhostProfile != "kiln/box.json":
		t.Errorf("seccomp %+v, want Localhost kiln/box.json", sc.SeccompProfile)
	}
	if ps := s.SecurityContext; ps == nil || ps.SeccompProfile == nil || ps.FSGroup != nil || ps.RunAsUser != nil {
		t.Errorf("the Pod's securityContext %+v: want a seccomp profile and no user or fsGroup (code's uid is the agent's business)", ps)
	}
	cmd := strings.Join(c.Command, " ")
	for _, arg := range []string{"-uid=1000000123", "-gid=1000000123", "-code-oom-score-adj=1000",
		"-code-rlimits=RLIMIT_CORE=0,RLIMIT_NOFILE=1024,RLIMIT_NPROC=" + strconv.Itoa(sandbox.DefaultLimits.Pids)} {
		if !slices.Contains(c.Command, arg) {
			t.Errorf("the agent is not started with %s: %s", arg, cmd)
		}
	}
	if p.Labels[LabelUID] != "1000000123" {
		t.Errorf("the code's uid is not on the Pod for other replicas to avoid: labels %v", p.Labels)
	}
	if c.Command[0] != "/sbin/kiln-agent" || !c.Stdin || c.TTY || c.StdinOnce {
		t.Errorf("the agent is not the first process on a kept-open stdin: %v stdin=%v once=%v tty=%v", c.Command, c.Stdin, c.StdinOnce, c.TTY)
	}
	if !strings.Contains(cmd, "-await-host") {
		t.Error("the agent does not wait for the host's attach before its hello")
	}
	if q := testPod(t, func(c *podConfig) { c.UID, c.GID = 0, 0 }); !slices.Contains(q.Spec.Containers[0].Command, "-uid=65534") {
		t.Errorf("a config without a uid runs code as %v", q.Spec.Containers[0].Command)
	}
	if q := testPod(t, func(c *podConfig) { c.RuntimeClass = "gvisor" }); !slices.Equal(q.Spec.Containers[0].SecurityContext.Capabilities.Add, []corev1.Capability{"CHOWN", "DAC_OVERRIDE", "KILL", "SETGID", "SETUID"}) {
		t.Errorf("under gVisor the agent's capabilities are %v: where it cannot take code's file ids it needs CHOWN and DAC_OVERRIDE", q.Spec.Containers[0].SecurityContext.Capabilities.Add)
	}
	// Limits; memory and storage requested as much as their limits.
	lim := c.Resources.Limits
	for _, r := range []corev1.ResourceName{corev1.ResourceMemory, corev1.ResourceCPU, corev1.ResourceEphemeralStorage} {
		q, ok := lim[r]
		if !ok || q.IsZero() {
			t.Errorf("no %s limit", r)
		}
		if rq := c.Resources.Requests[r]; r != corev1.ResourceCPU && rq.Cmp(q) != 0 {
			t.Errorf("%s request %s differs from its limit %s", r, rq.String(), q.String())
		}
	}
	if got := lim[corev1.ResourceCPU]; got.MilliValue() != 500 {
		t.Errorf("cpu limit %s, want 500m", got.String())
	}
	if got := lim[corev1.ResourceMemory]; got.Value() < 256<<20 {
		t.Errorf("memory limit %s is below the box's memory", got.String())
	}
	// Volumes: memory-backed, size-capped, at the plan's paths.
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m.MountPath
		if m.ReadOnly {
			t.Errorf("%s is mounted read-only", m.MountPath)
		}
	}
	want := map[string]struct {
		path string
		size int64
	}{"work": {boxpolicy.Workspace, sandbox.DefaultLimits.WorkspaceBytes}, "tmp": {boxpolicy.Tmp, sandbox.DefaultLimits.TmpBytes}, "shm": {boxpolicy.DevShm, boxpolicy.DevShmBytes}}
	for _, v := range s.Volumes {
		w, ok := want[v.Name]
		if !ok {
			t.Errorf("unexpected volume %s", v.Name)
			continue
		}
		delete(want, v.Name)
		if v.EmptyDir == nil || v.EmptyDir.Medium != corev1.StorageMediumMemory || v.EmptyDir.SizeLimit == nil || v.EmptyDir.SizeLimit.Value() != w.size {
			t.Errorf("volume %s: %+v, want a memory emptyDir of %d bytes", v.Name, v.VolumeSource, w.size)
		}
		if mounts[v.Name] != w.path {
			t.Errorf("volume %s mounted at %q, want %q", v.Name, mounts[v.Name], w.path)
		}
	}
	for n := range want {
		t.Errorf("no volume %s", n)
	}
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, "KUBERNETES") {
			t.Errorf("environment names the API server: %s", e.Name)
		}
	}
}

func TestPodBookkeeping(t *testing.T) {
	exp := time.Date(2026, 12, 1, 2, 0, 0, 0, time.UTC)
	p := testPod(t, func(c *podConfig) { c.Expires = exp; c.RuntimeClass = "gvisor" })
	if p.Labels[LabelManagedBy] != ManagedBy || p.Labels[LabelComponent] != "box" || p.Labels[LabelReplica] != "r1" {
		t.Errorf("labels %v", p.Labels)
	}
	if !boxSelector().Matches(labels.Set(p.Labels)) {
		t.Error("the box selector does not select a box")
	}
	if p.Annotations[AnnotationBoxID] != "box/1" || p.Annotations[AnnotationExpires] != "2026-12-01T02:00:00Z" {
		t.Errorf("annotations %v", p.Annotations)
	}
	if !expired(p, exp.Add(time.Second)) || expired(p, exp.Add(-time.Second)) {
		t.Error("the TTL annotation is not read back")
	}
	if len(p.OwnerReferences) != 1 || p.OwnerReferences[0].Kind != "Lease" {
		t.Errorf("owner references %v, want the replica's Lease", p.OwnerReferences)
	}
	if p.Spec.RuntimeClassName == nil || *p.Spec.RuntimeClassName != "gvisor" {
		t.Error("the RuntimeClass is not set")
	}
	if q := testPod(t, func(c *podConfig) { c.SeccompProfile = "" }); q.Spec.Containers[0].SecurityContext.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Error("without a Localhost profile the runtime's default is not asked for")
	}
	for _, msg := range validation.IsValidLabelValue(p.Labels[LabelBox]) {
		t.Errorf("box label: %s", msg)
	}
}

func TestNames(t *testing.T) {
	for _, id := range []string{"", "box-1", "Box_1/../x", strings.Repeat("a", 300), "--", "ü", "a.b.c", "-x-"} {
		n := podName(id, "0a1b2c3d")
		for _, msg := range validation.IsDNS1123Label(n) {
			t.Errorf("podName(%q) = %q: %s", id, n, msg)
		}
		v := labelValue(id)
		for _, msg := range validation.IsValidLabelValue(v) {
			t.Errorf("labelValue(%q) = %q: %s", id, v, msg)
		}
	}
	if labelValue("a/b") == labelValue("a_b") {
		t.Error("two IDs share a label value")
	}
	if labelValue("box-1") != "box-1" {
		t.Error("a valid value was changed")
	}
}

// TestSeccompProfile checks that the profile is kiln's policy, rule for
// rule, with ENOSYS (a trace action with no tracer) for what it does not
// name and what it makes absent; a call's refusal without checks after
// rules with them is the default action, an allowance the masked compares
// of what those do not match.
func TestSeccompProfile(t *testing.T) {
	var p specs.LinuxSeccomp
	if err := json.Unmarshal(SeccompProfile(), &p); err != nil {
		t.Fatal(err)
	}
	if p.DefaultAction != specs.ActTrace {
		t.Errorf("default %s, want a trace (ENOSYS)", p.DefaultAction)
	}
	var sawDeny, sawAbsent, sawArgs bool
	i := 0
	for _, r := range boxpolicy.SyscallPolicy {
		if len(r.Args) == 0 && slices.ContainsFunc(p.Syscalls[:i], func(s specs.LinuxSyscall) bool {
			return len(s.Args) > 0 && slices.Contains(s.Names, r.Names[0])
		}) {
			want := map[boxpolicy.SyscallAction]specs.LinuxSeccompAction{boxpolicy.Allow: specs.ActAllow, boxpolicy.Deny: specs.ActErrno}[r.Action]
			n := 0
			for ; i < len(p.Syscalls); i, n = i+1, n+1 {
				s := p.Syscalls[i]
				if !slices.Equal(s.Names, r.Names) || s.Action != want || len(s.Args) != 1 || s.Args[0].Op != specs.OpMaskedEqual {
					break
				}
			}
			if (n == 0) != (r.Action != boxpolicy.Allow) {
				t.Errorf("%v %s after its argument rules: %d rules for what they do not match", r.Names, r.Action, n)
			}
			continue
		}
		s := p.Syscalls[i]
		i++
		if strings.Join(s.Names, ",") != strings.Join(r.Names, ",") {
			t.Fatalf("rule %d: names %v, want %v", i-1, s.Names, r.Names)
		}
		switch r.Action {
		case boxpolicy.Allow:
			if s.Action != specs.ActAllow {
				t.Errorf("rule %d (%v) is not allowed", i, r.Names)
			}
		case boxpolicy.Deny:
			sawDeny = true
			if s.Action != specs.ActErrno || *s.ErrnoRet != 1 {
				t.Errorf("rule %d (%v) does not fail with EPERM", i, r.Names)
			}
		case boxpolicy.Absent:
			sawAbsent = true
			if s.Action != specs.ActTrace {
				t.Errorf("rule %d (%v) does not fail with ENOSYS", i, r.Names)
			}
		}
		if len(s.Args) != len(r.Args) {
			t.Fatalf("rule %d: %d argument checks, want %d", i, len(s.Args), len(r.Args))
		}
		for j, a := range r.Args {
			sawArgs = true
			if g := s.Args[j]; g.Op != specs.OpMaskedEqual || g.Value != a.Mask || g.ValueTwo != a.Value || g.Index != a.Index {
				t.Errorf("rule %d arg %d: %+v, want mask %#x value %#x", i, j, g, a.Mask, a.Value)
			}
		}
	}
	if i != len(p.Syscalls) {
		t.Errorf("%d rules, want %d", len(p.Syscalls), i)
	}
	if !sawDeny || !sawAbsent || !sawArgs {
		t.Error("the policy has no refusal, no absent call or no argument check to compare")
	}
}
