package jail_test

import (
	"context"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// TestEarlyBoxWhileTemplateWarms: a box a call waits for, asked right
// after the backend starts, does not wait for the zygote template: it is
// started directly without the preloads, and works. Once the template is
// ready, urgent boxes are forked from it again, with the preloads.
func TestEarlyBoxWhileTemplateWarms(t *testing.T) {
	b := newZygoteBackend(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// tabnanny: a module nothing in the box imports by itself.
	spec := sandbox.Spec{ID: "early", Preload: []string{"tabnanny"}, Urgent: true}
	preloaded := func(box sandbox.Sandbox) string {
		t.Helper()
		res, err := box.RunPython(ctx, "import sys; print(2+2, 'tabnanny' in sys.modules)", sandbox.ExecOptions{})
		if err != nil || res.Error != nil {
			t.Fatalf("running a cell: %v %+v", err, res)
		}
		return res.Stdout.Text
	}

	early, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatalf("creating a box right after start: %v", err)
	}
	defer early.Close()
	if got := preloaded(early); got != "4 False\n" {
		t.Errorf("early box printed %q, want 4 and no preloads (a plain box)", got)
	}

	// A pool's box waits for the template, and has the preloads.
	spec.ID, spec.Urgent = "pooled", false
	pooled, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer pooled.Close()
	if got := preloaded(pooled); got != "4 True\n" {
		t.Errorf("pooled box printed %q, want the preloads (forked from the template)", got)
	}

	spec.ID, spec.Urgent = "late", true
	late, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	if got := preloaded(late); got != "4 True\n" {
		t.Errorf("urgent box after the template is ready printed %q, want the preloads (forked)", got)
	}
}
