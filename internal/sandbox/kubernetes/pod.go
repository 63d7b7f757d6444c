package kubernetes

import (
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kiln/internal/boxpolicy"
	"kiln/internal/guestinit"
	"kiln/internal/sandbox"
)

// Labels and annotations kiln puts on what it creates. They are the whole
// bookkeeping: a replica keeps nothing about a box that another replica
// could not read back from the API.
const (
	// LabelManagedBy marks every object kiln made; its value is ManagedBy.
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedBy      = "kiln"
	// LabelReplica names the kiln replica that created a box (its Lease).
	LabelReplica = "kiln.dev/replica"
	// LabelBox is the box's sandbox.Spec ID, made safe for a label value.
	LabelBox = "kiln.dev/box"
	// LabelComponent is "box" on boxes and "replica" on replica Leases.
	LabelComponent = "app.kubernetes.io/component"
	// AnnotationExpires is when a box may be deleted by any replica even
	// if its own replica still lives (RFC 3339, UTC).
	AnnotationExpires = "kiln.dev/expires"
	// AnnotationBoxID is the box's sandbox.Spec ID as given.
	AnnotationBoxID = "kiln.dev/box-id"
	// LabelUID is the host uid (and gid) the box's code runs as, which
	// replicas choosing one for a new box avoid.
	LabelUID = "kiln.dev/uid"
)

// ContainerName is the name of the one container of a box's Pod.
const ContainerName = "box"

// codeOOMScoreAdj is code's oom_score_adj: the highest, so that when the
// box's memory runs out (its workspace's files count against it) the OOM
// killer takes code, never the agent. The agent keeps the kubelet's.
const codeOOMScoreAdj = 1000

// podConfig is what one box's Pod is made from.
type podConfig struct {
	Name         string
	Namespace    string
	BoxID        string
	Image        string
	PullPolicy   corev1.PullPolicy
	RuntimeClass string // "": the cluster's default runtime
	// SeccompProfile is a Localhost profile's path relative to the
	// kubelet's seccomp directory; "": the runtime's default profile.
	SeccompProfile string
	Limits         sandbox.Limits // defaults applied
	Preload        []string
	Replica        string // the creating replica's name
	Owner          *metav1.OwnerReference
	Expires        time.Time // zero: no TTL
	// UID and GID of the box's code, the box's own (pickUID); the agent
	// runs as root.
	UID, GID int64
	// Net is the box's network through the egress gateway; nil: none.
	Net *podNet
}

// The agent is the container's first process and runs as root, with only
// the capabilities it needs to start code as the box's own uid and to stop
// it, as on gVisor and in the microVM: SETUID and SETGID to start code as
// that user, KILL to interrupt and kill it. A container runtime gives a
// non-root container no effective capabilities whatever the Pod adds, so a
// non-root agent could only run code as its own uid, and code could then
// signal, stop and trace the process that holds the host's channel. The
// file tools take the code's file ids on a thread (setfsuid, under
// SETUID/SETGID), so they read and write only what code could; where the
// runtime ignores setfsuid (gVisor) the agent acts as itself and needs
// CHOWN to give what it writes to code and DAC_OVERRIDE to read what code
// keeps private. Code gets none of them: the change of uid clears them
// and no_new_privs (allowPrivilegeEscalation: false) keeps them off.
var (
	agentCaps       = []corev1.Capability{"KILL", "SETGID", "SETUID"}
	agentCapsGVisor = []corev1.Capability{"CHOWN", "DAC_OVERRIDE", "KILL", "SETGID", "SETUID"}
)

// capsFor are the agent's capabilities under a RuntimeClass: runc's ("" is
// taken as runc, the usual default) or gVisor's (any other).
func capsFor(runtimeClass string) []corev1.Capability {
	if runtimeClass == "" || runtimeClass == "runc" {
		return slices.Clone(agentCaps)
	}
	return slices.Clone(agentCapsGVisor)
}

// memSlack is added to the container's memory limit for what the box's
// tmpfs volumes may hold: Kubernetes charges memory-backed emptyDirs to the
// container, while the sandbox.Limits memory is what code may allocate.
// The workspace and /tmp are capped by their own sizeLimits.
func memLimit(l sandbox.Limits) int64 {
	return l.MemoryBytes + l.WorkspaceBytes + l.TmpBytes + boxpolicy.DevShmBytes
}

// buildPod returns the Pod of a box: kiln-agent as the container's first
// process, as root with the capabilities of agentCaps, starting code as
// the box's own uid with the box plan's rlimits (RLIMIT_NPROC is then the
// box's pids limit) and the highest oom_score_adj; the container hardened
// as the jail's box is (read-only root, no privilege escalation, kiln's
// syscall policy as seccomp, no service-account token, no host namespaces)
// and bounded by the box's limits. Its workspace, /tmp and /dev/shm are
// memory-backed emptyDirs with size limits, as the jail's tmpfs are.
func buildPod(c podConfig) *corev1.Pod {
	l := c.Limits
	f, t := false, true
	uid, gid := c.UID, c.GID
	if uid <= 0 || gid <= 0 {
		// A config that names no uid (a bug) never runs code as root.
		uid, gid = boxpolicy.Nobody, boxpolicy.Nobody
	}
	root := int64(0)
	plan := l.Plan(int(uid), int(gid))
	var rlimits []string
	for _, r := range plan.Rlimits {
		rlimits = append(rlimits, r.Name+"="+strconv.FormatUint(r.Value, 10))
	}
	seccomp := &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}
	if c.SeccompProfile != "" {
		p := c.SeccompProfile
		seccomp = &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeLocalhost, LocalhostProfile: &p}
	}
	mem := resource.NewQuantity(memLimit(l), resource.BinarySI)
	cpu := resource.NewMilliQuantity(int64(l.CPUs*1000), resource.DecimalSI)
	// The writable layer is read-only; what is left on disk is the
	// agent's log.
	eph := resource.MustParse("64Mi")
	limits := corev1.ResourceList{
		corev1.ResourceMemory:           *mem,
		corev1.ResourceCPU:              *cpu,
		corev1.ResourceEphemeralStorage: eph,
	}
	// Memory and storage requests equal their limits: the scheduler places
	// a box where its memory fits. CPU is asked for at a tenth of its
	// limit: it is compressible, the limit bounds the box, and boxes wait
	// idle most of their lives.
	requests := limits.DeepCopy()
	requests[corev1.ResourceCPU] = *resource.NewMilliQuantity(max(int64(l.CPUs*100), 10), resource.DecimalSI)
	var env []corev1.EnvVar
	dns := &corev1.PodDNSConfig{Nameservers: []string{"127.0.0.1"}}
	boxEnv := append(append([]string(nil), boxpolicy.Env...), boxpolicy.UserEnv(int(uid))...)
	if c.Net != nil {
		// The gateway is the box's one resolver and its proxy; the
		// egress NetworkPolicy lets it reach those and nothing else.
		two := "2"
		dns = &corev1.PodDNSConfig{Nameservers: []string{c.Net.Gateway.String()},
			Options: []corev1.PodDNSConfigOption{{Name: "attempts", Value: &two}, {Name: "timeout", Value: &two}}}
		boxEnv = append(boxEnv, c.Net.Env...)
	}
	for _, kv := range boxEnv {
		k, v, _ := strings.Cut(kv, "=")
		env = append(env, corev1.EnvVar{Name: k, Value: v})
	}
	labels := map[string]string{
		LabelManagedBy: ManagedBy,
		LabelComponent: "box",
		LabelReplica:   labelValue(c.Replica),
		LabelBox:       labelValue(c.BoxID),
		LabelUID:       strconv.FormatInt(uid, 10),
	}
	if c.Net != nil {
		labels[LabelEgress] = c.Net.Gateway.String()
	}
	ann := map[string]string{AnnotationBoxID: c.BoxID}
	if !c.Expires.IsZero() {
		ann[AnnotationExpires] = c.Expires.UTC().Format(time.RFC3339)
	}
	var owners []metav1.OwnerReference
	if c.Owner != nil {
		owners = []metav1.OwnerReference{*c.Owner}
	}
	var rc *string
	if c.RuntimeClass != "" {
		r := c.RuntimeClass
		rc = &r
	}
	grace := int64(0)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:            c.Name,
			Namespace:       c.Namespace,
			Labels:          labels,
			Annotations:     ann,
			OwnerReferences: owners,
		},
		Spec: corev1.PodSpec{
			RestartPolicy:                 corev1.RestartPolicyNever,
			AutomountServiceAccountToken:  &f,
			EnableServiceLinks:            &f,
			HostNetwork:                   false,
			HostPID:                       false,
			HostIPC:                       false,
			ShareProcessNamespace:         &f,
			RuntimeClassName:              rc,
			TerminationGracePeriodSeconds: &grace,
			Hostname:                      boxpolicy.Hostname,
			DNSPolicy:                     corev1.DNSNone,
			DNSConfig:                     dns,
			SecurityContext: &corev1.PodSecurityContext{
				SeccompProfile: seccomp,
			},
			Containers: []corev1.Container{{
				Name:            ContainerName,
				Image:           c.Image,
				ImagePullPolicy: c.PullPolicy,
				Command: []string{guestinit.AgentPath, "-await-host", "-workspace=" + boxpolicy.Workspace,
					"-preload=" + strings.Join(c.Preload, ","),
					"-uid=" + strconv.FormatInt(uid, 10), "-gid=" + strconv.FormatInt(gid, 10),
					"-code-rlimits=" + strings.Join(rlimits, ","),
					"-code-oom-score-adj=" + strconv.Itoa(codeOOMScoreAdj)},
				Env:        env,
				WorkingDir: boxpolicy.Workspace,
				Stdin:      true,
				StdinOnce:  false,
				TTY:        false,
				Resources:  corev1.ResourceRequirements{Limits: limits, Requests: requests},
				SecurityContext: &corev1.SecurityContext{
					RunAsUser:                &root,
					RunAsGroup:               &root,
					Privileged:               &f,
					AllowPrivilegeEscalation: &f,
					ReadOnlyRootFilesystem:   &t,
					Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}, Add: capsFor(c.RuntimeClass)},
					SeccompProfile:           seccomp,
					ProcMount:                nil,
				},
				VolumeMounts: []corev1.VolumeMount{
					{Name: "work", MountPath: boxpolicy.Workspace},
					{Name: "tmp", MountPath: boxpolicy.Tmp},
					{Name: "shm", MountPath: boxpolicy.DevShm},
				},
				TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
			}},
			Volumes: []corev1.Volume{
				memVolume("work", l.WorkspaceBytes),
				memVolume("tmp", l.TmpBytes),
				memVolume("shm", boxpolicy.DevShmBytes),
			},
		},
	}
	if v, m := trustVolume(c.Net); v != nil {
		pod.Spec.Volumes = append(pod.Spec.Volumes, *v)
		pod.Spec.Containers[0].VolumeMounts = append(pod.Spec.Containers[0].VolumeMounts, *m)
	}
	return pod
}

// memVolume is a memory-backed emptyDir capped at size bytes: the kubelet
// mounts it as a tmpfs of that size.
func memVolume(name string, size int64) corev1.Volume {
	q := resource.NewQuantity(size, resource.BinarySI)
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{
		EmptyDir: &corev1.EmptyDirVolumeSource{Medium: corev1.StorageMediumMemory, SizeLimit: q},
	}}
}

// labelValue turns s into a valid label value (at most 63 characters of
// letters, digits, '-', '_' and '.', starting and ending alphanumeric); a
// value it had to change carries a hash of the original so two never meet.
func labelValue(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	v := b.String()
	if v == s && len(v) <= 63 && (v == "" || isAlnum(v[0]) && isAlnum(v[len(v)-1])) {
		return v
	}
	h := sha256.Sum256([]byte(s))
	sum := hex.EncodeToString(h[:])[:10]
	v = strings.Trim(v, "-_.")
	if len(v) > 52 {
		v = v[:52]
	}
	v = strings.Trim(v, "-_.")
	if v == "" {
		return "h" + sum
	}
	return v + "-" + sum
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// podName is a box's Pod name: "kiln-" and a DNS label made from the box
// ID and a random suffix (two replicas may draw the same ID).
func podName(boxID, suffix string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(boxID) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteByte('-')
		}
	}
	id := strings.Trim(b.String(), "-")
	if max := 63 - len("kiln-") - 1 - len(suffix); len(id) > max {
		id = strings.Trim(id[:max], "-")
	}
	if id == "" {
		return "kiln-" + suffix
	}
	return "kiln-" + id + "-" + suffix
}
