package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"kiln/internal/image"
)

// TestTemplateImageKey: the template's ext4 image is made once per
// content of the template's files (a second server reuses it), a changed
// file gives a new image, and the image's path is in the VM's command
// line, so in the saved VM's key.
func TestTemplateImageKey(t *testing.T) {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("needs mkfs.ext4")
	}
	dir, state := t.TempDir(), t.TempDir()
	os.WriteFile(filepath.Join(dir, "a.txt"), []byte("a"), 0o644)
	ctx := context.Background()
	p1, err := templateImage(ctx, state, dir)
	if err != nil {
		t.Fatal(err)
	}
	st1, _ := os.Stat(p1)
	p2, err := templateImage(ctx, state, dir)
	if err != nil || p2 != p1 {
		t.Fatalf("same files: %s, then %s (%v)", p1, p2, err)
	}
	if st2, _ := os.Stat(p2); !st2.ModTime().Equal(st1.ModTime()) {
		t.Error("the image was made again for the same files")
	}
	os.WriteFile(filepath.Join(dir, "a.txt"), []byte("b"), 0o644)
	os.Chtimes(filepath.Join(dir, "a.txt"), time.Now().Add(time.Hour), time.Now().Add(time.Hour))
	p3, err := templateImage(ctx, state, dir)
	if err != nil || p3 == p1 {
		t.Fatalf("changed files kept the image %s (%v)", p3, err)
	}
	c1 := vmConfig{Template: p1}
	c3 := vmConfig{Template: p3}
	if !slices.Contains(c1.args(), "id=tpl,if=none,format=raw,readonly=on,file="+p1) {
		t.Errorf("no read-only template drive in %q", c1.args())
	}
	b := &Backend{opts: Options{Image: &image.Image{Key: "k"}}}
	if b.templateKey(c1) == b.templateKey(c3) {
		t.Error("two templates' VMs have the same key")
	}
	if slices.ContainsFunc((vmConfig{}).args(), func(a string) bool { return a == "virtio-blk-device,drive=tpl" }) {
		t.Error("a VM without a template has a template drive")
	}
}
