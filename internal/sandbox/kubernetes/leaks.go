package kubernetes

import (
	"context"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// Leftovers lists this replica's box Pods that are not live boxes of it:
// after every box is closed, there should be none (sandboxtest's leak
// check). A Pod being deleted counts until it is gone; the warm pool's
// untaken Pods count only once the backend is closed.
func (b *Backend) Leftovers() []string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sel := labels.SelectorFromSet(labels.Set{LabelManagedBy: ManagedBy, LabelComponent: "box", LabelReplica: b.opts.Replica})
	pods, err := b.cs.CoreV1().Pods(b.opts.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return []string{"listing boxes: " + err.Error()}
	}
	b.mu.Lock()
	closed := b.closed
	live := map[string]bool{}
	for id := range b.live {
		live[id] = true
	}
	b.mu.Unlock()
	var out []string
	for _, p := range pods.Items {
		if !closed && isPoolPod(&p) {
			continue
		}
		if !live[p.Annotations[AnnotationBoxID]] {
			out = append(out, "pod "+p.Namespace+"/"+p.Name+" ("+string(p.Status.Phase)+")")
		}
	}
	return out
}
