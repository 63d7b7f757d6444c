package boxkit

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// TestAlive: a running process is alive under its stamp and not under
// another start time; killed, it is dead while still a zombie (a killed
// server its parent has not reaped owns nothing), and after it is reaped.
func TestAlive(t *testing.T) {
	if !Self().Alive() {
		t.Fatalf("this process is not alive under its own stamp %v", Self())
	}
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	o, ok := Stamp(cmd.Process.Pid)
	if !ok || o.PID != cmd.Process.Pid {
		t.Fatalf("Stamp(%d) = %v, %v", cmd.Process.Pid, o, ok)
	}
	if !o.Alive() {
		t.Fatalf("a running process %v is not alive", o)
	}
	if Alive(o.PID, o.Start+1) {
		t.Fatalf("%v is alive under another start time (pid reuse)", o)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Not reaped yet: wait until it is a zombie.
	deadline := time.Now().Add(10 * time.Second)
	for o.Alive() {
		if time.Now().After(deadline) {
			t.Fatalf("a killed, unreaped process %v is still alive", o)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := os.Stat("/proc/" + itoa(o.PID)); err != nil {
		t.Fatalf("the zombie is gone before it was reaped; the check is blind: %v", err)
	}
	cmd.Wait()
	if o.Alive() {
		t.Fatalf("a reaped process %v is alive", o)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

func TestParseOwner(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Owner
		rest string
		ok   bool
	}{
		{"123.456.kiln-s1-0a1b2c3d4e5f", Owner{123, 456}, ".kiln-s1-0a1b2c3d4e5f", true},
		{"1.2.kiln-template-0123456789abcdef-00112233", Owner{1, 2}, ".kiln-template-0123456789abcdef-00112233", true},
		{"1 0", Owner{1, 0}, "", true},
		{"77.88-abc", Owner{77, 88}, "-abc", true},
		{"77.88", Owner{77, 88}, "", true},
		{"kiln-template-0123456789abcdef-001122334455", Owner{}, "", false},
		{"kiln-s1.x-0a1b", Owner{}, "", false},
		{"12.kiln-x", Owner{}, "", false},
		{"12.x1.kiln", Owner{}, "", false},
		{"12-abc", Owner{}, "", false},
		{"12.34x", Owner{}, "", false},
		{"0.5", Owner{}, "", false},
		{"", Owner{}, "", false},
	} {
		o, rest, ok := ParseOwner(c.in)
		if o != c.want || rest != c.rest || ok != c.ok {
			t.Errorf("ParseOwner(%q) = %v, %q, %v; want %v, %q, %v", c.in, o, rest, ok, c.want, c.rest, c.ok)
		}
	}
	self := Self()
	if o, rest, ok := ParseOwner(self.String()); !ok || o != self || rest != "" {
		t.Errorf("ParseOwner(%q) = %v, %q, %v; want it back", self.String(), o, rest, ok)
	}
}

// TestSweepOrphans: of a dead owner's entry, a live owner's, one without a
// stamp and one of another prefix, only the first goes.
func TestSweepOrphans(t *testing.T) {
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	dead := Owner{PID: gone.Process.Pid, Start: 1} // no process has it
	dir := t.TempDir()
	names := []string{"root-" + dead.String() + "-a", "root-" + Self().String() + "-b", "root-junk", "other-" + dead.String()}
	for _, n := range names {
		if err := os.Mkdir(filepath.Join(dir, n), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	n, err := SweepOrphans(dir, "root-", func(p string) error { got = append(got, filepath.Base(p)); return os.Remove(p) })
	if err != nil || n != 1 || !slices.Equal(got, names[:1]) {
		t.Fatalf("SweepOrphans = %d, %v, removed %v; want 1, nil, %v", n, err, got, names[:1])
	}
	if n, err := SweepOrphans(filepath.Join(dir, "missing"), "root-", nil); n != 0 || err != nil {
		t.Errorf("SweepOrphans of a missing directory = %d, %v", n, err)
	}
}
