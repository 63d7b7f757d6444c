package smoke

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
)

// podPidsLimit is the kubelet's podPidsLimit in cluster.sh.
const podPidsLimit = "1024"

// TestPodPidsLimit proves the kubelet caps every Pod's processes and
// threads at podPidsLimit: the Pod's own cgroup (the node's view, which
// the Pod cannot change) has pids.max set to it.
func TestPodPidsLimit(t *testing.T) {
	_, cs, reg := cluster(t)
	if os.Geteuid() != 0 {
		t.Skip("reads the node's cgroups: needs root")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ref := pushProbe(t, reg)
	ns := "kiln-pids-" + rand.String(6)
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cs.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	})
	pod := startServer(ctx, t, cs, ns, "pids", ref, nil)
	got, err := podPidsMax(string(pod.UID))
	if err != nil {
		t.Fatal(err)
	}
	if got != podPidsLimit {
		t.Errorf("the Pod's cgroup has pids.max %q, want the kubelet's podPidsLimit %s", got, podPidsLimit)
	}
}

// podPidsMax reads pids.max of the Pod's cgroup (cgroupfs driver: v1's
// pids hierarchy or the unified one; any QoS class).
func podPidsMax(uid string) (string, error) {
	var found []string
	for _, root := range []string{"/sys/fs/cgroup/pids/kubepods", "/sys/fs/cgroup/kubepods"} {
		for _, pat := range []string{root + "/pod" + uid + "/pids.max", root + "/*/pod" + uid + "/pids.max"} {
			m, _ := filepath.Glob(pat)
			found = append(found, m...)
		}
	}
	if len(found) == 0 {
		return "", fmt.Errorf("no pids.max for Pod %s under /sys/fs/cgroup", uid)
	}
	b, err := os.ReadFile(found[0])
	return strings.TrimSpace(string(b)), err
}
