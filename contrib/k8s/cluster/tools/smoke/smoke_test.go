// Package smoke proves the test cluster works end to end: an image is
// pushed to the cluster's registry, a hardened Pod runs it (through each
// RuntimeClass the cluster has), the test execs into it and reads the
// answer, and the Pod is deleted.
//
// It runs against the cluster `make k8s-cluster` starts (KUBECONFIG and
// KILN_K8S_REGISTRY from `contrib/k8s/cluster/cluster.sh env`). Without
// KUBECONFIG it skips, unless KILN_K8S_SMOKE=1 says a cluster must be there.
package smoke

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/remotecommand"

	"kiln/contrib/k8s/cluster/tools/ociimage"
)

func cluster(t *testing.T) (*rest.Config, *kubernetes.Clientset, string) {
	kc := os.Getenv("KUBECONFIG")
	if kc == "" {
		if os.Getenv("KILN_K8S_SMOKE") == "1" {
			t.Fatal("KILN_K8S_SMOKE=1 but KUBECONFIG is not set (run `make k8s-cluster`)")
		}
		t.Skip("no KUBECONFIG: start the test cluster with `make k8s-cluster`")
	}
	reg := os.Getenv("KILN_K8S_REGISTRY")
	if reg == "" {
		reg = "localhost:5000"
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cfg, cs, reg
}

// pushProbe builds ../probe statically and pushes it as a one-file image.
func pushProbe(t *testing.T, reg string) string {
	bin := filepath.Join(t.TempDir(), "probe")
	cmd := exec.Command("go", "build", "-trimpath", "-o", bin, "kiln/contrib/k8s/cluster/tools/probe")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build probe: %v\n%s", err, out)
	}
	ref := reg + "/kiln/smoke-probe:" + rand.String(8)
	digest, err := ociimage.Push(ref, "/probe", "65534:65534", []string{"probe=" + bin})
	if err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	t.Logf("pushed %s@%s", ref, digest)
	return ref
}

func TestPodFromLocalRegistry(t *testing.T) {
	cfg, cs, reg := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	ref := pushProbe(t, reg)
	ns := "kiln-smoke-" + rand.String(6)
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cs.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	})

	rcs, err := cs.NodeV1().RuntimeClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(rcs.Items) == 0 {
		t.Fatal("the cluster has no RuntimeClass (cluster.sh up makes runc's)")
	}
	for _, rc := range rcs.Items {
		t.Run(rc.Name, func(t *testing.T) {
			runProbe(ctx, t, cfg, cs, ns, rc.Name, ref)
		})
	}
}

func runProbe(ctx context.Context, t *testing.T, cfg *rest.Config, cs *kubernetes.Clientset, ns, rc, ref string) {
	no, yes := false, true
	uid := int64(65534)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "probe-" + rc, Labels: map[string]string{"app.kubernetes.io/name": "kiln-smoke"}},
		Spec: corev1.PodSpec{
			RuntimeClassName:              &rc,
			AutomountServiceAccountToken:  &no,
			EnableServiceLinks:            &no,
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: new(int64),
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: &yes, RunAsUser: &uid, RunAsGroup: &uid,
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			Containers: []corev1.Container{{
				Name:            "probe",
				Image:           ref,
				ImagePullPolicy: corev1.PullAlways,
				SecurityContext: &corev1.SecurityContext{
					AllowPrivilegeEscalation: &no,
					ReadOnlyRootFilesystem:   &yes,
					Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				},
				Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{
					corev1.ResourceMemory:           resource.MustParse("64Mi"),
					corev1.ResourceCPU:              resource.MustParse("500m"),
					corev1.ResourceEphemeralStorage: resource.MustParse("64Mi"),
				}},
			}},
		},
	}
	start := time.Now()
	if _, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var last *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := cs.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		last = p
		switch p.Status.Phase {
		case corev1.PodRunning:
			return true, nil
		case corev1.PodFailed, corev1.PodSucceeded:
			return false, fmt.Errorf("pod ended: %s", p.Status.Phase)
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("pod not Running: %v\nstatus: %+v\nevents:\n%s", err, last.Status, events(ctx, cs, ns))
	}
	t.Logf("runtimeclass %s: pod create → Running in %v", rc, time.Since(start).Round(time.Millisecond))

	out := execIn(ctx, t, cfg, cs, ns, pod.Name, "/probe", "echo", "hello", "from", rc)
	if out != "hello from "+rc+"\n" {
		t.Errorf("exec echo: got %q", out)
	}
	if out := execIn(ctx, t, cfg, cs, ns, pod.Name, "/probe", "id"); out != "uid=65534 gid=65534\n" {
		t.Errorf("exec id: got %q, want the Pod's non-root user", out)
	}

	if err := cs.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := cs.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, err
	})
	if err != nil {
		t.Fatalf("pod not deleted: %v", err)
	}
}

func execIn(ctx context.Context, t *testing.T, cfg *rest.Config, cs *kubernetes.Clientset, ns, pod string, argv ...string) string {
	req := cs.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: "probe", Command: argv, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ex, err := remotecommand.NewWebSocketExecutor(cfg, "GET", req.URL().String())
	if err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	if err := ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr}); err != nil {
		t.Fatalf("exec %v: %v (stderr %q)", argv, err, stderr.String())
	}
	return stdout.String()
}

func events(ctx context.Context, cs *kubernetes.Clientset, ns string) string {
	evs, err := cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range evs.Items {
		fmt.Fprintf(&b, "  %s %s: %s\n", e.InvolvedObject.Name, e.Reason, e.Message)
	}
	return b.String()
}
