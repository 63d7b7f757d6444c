package wasm

import (
	"context"
	"testing"

	"kiln/internal/sandbox"
)

// BenchmarkRunPython is one session call, print(2+2), on a box.
func BenchmarkRunPython(b *testing.B) {
	bk, err := New(Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer bk.Close()
	ctx := context.Background()
	bx, err := bk.Create(ctx, sandbox.Spec{ID: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	defer bx.Close()
	for b.Loop() {
		if _, err := bx.RunPython(ctx, "print(2+2)", sandbox.ExecOptions{MaxOutput: 1024}); err != nil {
			b.Fatal(err)
		}
	}
}
