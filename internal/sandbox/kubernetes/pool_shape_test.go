package kubernetes

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kiln/internal/sandbox"
)

// TestShape: two Pods of one shape differ only in what is each Pod's own;
// anything a box spec or the replica's options decide changes the shape.
func TestShape(t *testing.T) {
	base := podConfig{Name: "kiln-a-1", Namespace: "ns", BoxID: "a", Image: "reg/kiln/box:1",
		Limits: sandbox.DefaultLimits, Preload: []string{"numpy"}, Replica: "r1", UID: 1000, GID: 1000,
		Owner: &metav1.OwnerReference{Name: "kiln-replica-r1", UID: "u1"}}
	own := base
	own.Name, own.BoxID, own.Replica, own.Expires = "kiln-b-2", "b", "r2", time.Now()
	own.UID, own.GID = 2000, 2000
	own.Owner = &metav1.OwnerReference{Name: "kiln-replica-r2", UID: "u2"}
	if shapeOf(own) != shapeOf(base) {
		t.Error("name, box ID, replica, owner, TTL or uid changed the shape")
	}
	for name, edit := range map[string]func(*podConfig){
		"image":         func(c *podConfig) { c.Image = "reg/kiln/box:2" },
		"preload":       func(c *podConfig) { c.Preload = []string{"numpy", "pandas"} },
		"memory":        func(c *podConfig) { c.Limits.MemoryBytes *= 2 },
		"cpus":          func(c *podConfig) { c.Limits.CPUs = 2 },
		"runtime class": func(c *podConfig) { c.RuntimeClass = "gvisor" },
		"seccomp":       func(c *podConfig) { c.SeccompProfile = "kiln/box.json" },
	} {
		c := base
		c.Limits = base.Limits
		c.Preload = append([]string(nil), base.Preload...)
		edit(&c)
		if shapeOf(c) == shapeOf(base) {
			t.Errorf("%s: same shape", name)
		}
	}
}
