package agent

import (
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestServeAttachedStartsKernelBeforeHost: the kernel (and its preloads)
// starts when the agent does, not when the first host attaches, so a Pod
// that waits in the warm pool is ready when it is taken. The "python" here
// only records that it was started.
func TestServeAttachedStartsKernelBeforeHost(t *testing.T) {
	dir := t.TempDir()
	started := filepath.Join(dir, "started")
	py := filepath.Join(dir, "python")
	if err := os.WriteFile(py, []byte("#!/bin/sh\n: > "+started+"\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	ar, hw := io.Pipe() // no host attaches: nothing is written
	a := New(Config{Workspace: t.TempDir(), Python: py, UID: -1, GID: -1})
	done := make(chan error, 1)
	go func() { done <- a.ServeAttached(ar, io.Discard) }()
	t.Cleanup(func() { hw.Close(); <-done })
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(started); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no host has attached, and the kernel has not been started")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
