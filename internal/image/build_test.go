package image_test

import (
	"context"
	"os"
	"testing"

	"kiln/internal/image"
	"kiln/internal/image/imagetest"
)

// TestBuild builds the guest image (minutes the first time) and checks that
// building again with the same inputs is a no-op.
func TestBuild(t *testing.T) {
	im := imagetest.Image(t)
	for _, p := range []string{im.KernelPath(), im.InitrdPath(), im.RootfsPath()} {
		if fi, err := os.Stat(p); err != nil || fi.Size() == 0 {
			t.Errorf("image file %s: %v", p, err)
		}
	}
	if im.Python == "" || len(im.Libraries) == 0 {
		t.Errorf("image does not describe its runtime: %+v", im)
	}
	before, err := os.Stat(im.RootfsPath())
	if err != nil {
		t.Fatal(err)
	}
	again, err := image.Build(context.Background(), imagetest.Options(t))
	if err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(again.RootfsPath())
	if err != nil {
		t.Fatal(err)
	}
	if again.Dir != im.Dir || !after.ModTime().Equal(before.ModTime()) {
		t.Errorf("rebuild with the same inputs was not a no-op: %s → %s", im.Dir, again.Dir)
	}
	found, err := image.Lookup(imagetest.Options(t))
	if err != nil || found.Dir != im.Dir {
		t.Errorf("Lookup = %v, %v; want %s", found, err, im.Dir)
	}
}
