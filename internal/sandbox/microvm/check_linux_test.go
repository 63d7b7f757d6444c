package microvm_test

import (
	"context"
	"testing"
	"time"

	"kiln/internal/sandbox/microvm"
)

// TestCheckStartsAVM: Check proves that a VM starts and runs code, not only
// that QEMU and the image are there (kiln doctor relies on it): with a boot
// timeout no VM can meet it fails, and otherwise it passes.
func TestCheckStartsAVM(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	b := newBackend(t, microvm.Options{ColdBoot: true, BootTimeout: time.Millisecond})
	if err := b.Check(ctx); err == nil {
		t.Error("Check passed though no VM can boot: it does not start one")
	}
	b = newBackend(t, microvm.Options{ColdBoot: true})
	if err := b.Check(ctx); err != nil {
		t.Errorf("Check: %v", err)
	}
}
