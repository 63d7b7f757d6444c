package sandboxtest

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// resultView flattens a result for assertions.
type resultView struct {
	*agentproto.ExecResult
	out string // stdout + stderr
}

func view(r *agentproto.ExecResult) *resultView {
	return &resultView{ExecResult: r, out: r.Stdout.Text + r.Stderr.Text}
}

func (r *resultView) value() string { return r.Result["text/plain"] }

func canary() string {
	var b [8]byte
	rand.Read(b[:])
	return "kiln-canary-" + hex.EncodeToString(b[:])
}

type testCase struct {
	name string
	fn   func(t *testing.T, s *suite)
}

// cases is the contract. Each states what must hold.
var cases = []testCase{
	{"python state persists and shell shares the workspace", func(t *testing.T, s *suite) {
		box := s.box(t)
		if r := py(t, s, box, "x = 6 * 7\nopen('from_py.txt', 'w').write('hello')\nx"); r.value() != "42" {
			t.Fatalf("value %q, error %+v", r.value(), r.Error)
		}
		if r := py(t, s, box, "x + 1"); r.value() != "43" {
			t.Errorf("state lost: %q", r.value())
		}
		if r := sh(t, s, box, "cat from_py.txt; pwd; echo oops >&2; exit 3"); r.Stdout.Text != "hello/work\n" || r.Stderr.Text != "oops\n" || r.ExitCode != 3 {
			t.Errorf("shell: %+v", r.ExecResult)
		}
	}},
	{"exceptions come back with the cell's traceback", func(t *testing.T, s *suite) {
		r := py(t, s, s.box(t), "def f(n):\n    return 10 / n\nf(0)")
		if r.Error == nil || r.Error.Name != "ZeroDivisionError" || !strings.Contains(r.Error.Traceback, "return 10 / n") {
			t.Errorf("error: %+v", r.Error)
		}
	}},
	{"interrupt stops a runaway cell and the kernel survives", func(t *testing.T, s *suite) {
		box := s.box(t)
		py(t, s, box, "y = 1")
		go func() {
			time.Sleep(s.timeout(time.Second))
			box.Interrupt(s.ctx(t, 10*time.Second))
		}()
		r := py(t, s, box, "while True:\n    pass")
		if r.Error == nil || r.Error.Name != "KeyboardInterrupt" {
			t.Fatalf("not interrupted: %+v", r.Error)
		}
		if r := py(t, s, box, "y"); r.value() != "1" {
			t.Errorf("state after interrupt: %q", r.value())
		}
	}},
	{"the host environment is invisible", func(t *testing.T, s *suite) {
		c := canary()
		os.Setenv("KILN_TEST_SECRET", c)
		defer os.Unsetenv("KILN_TEST_SECRET")
		box := s.box(t)
		if s.opts.NoShell != "" {
			r := py(t, s, box, "import os\nprint(dict(os.environ))\nfor p in ('/proc/self/environ', '/proc/1/environ'):\n    try:\n        print(open(p).read())\n    except OSError:\n        pass")
			if strings.Contains(r.out, c) || strings.Contains(r.out, "KILN_TEST_SECRET") {
				t.Errorf("host environment visible in the box")
			}
			return
		}
		r := sh(t, s, box, "env; cat /proc/1/environ /proc/self/environ 2>/dev/null | tr '\\0' '\\n'; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'")
		if strings.Contains(r.out, c) || strings.Contains(r.out, "KILN_TEST_SECRET") {
			t.Errorf("host environment visible in the box")
		}
	}},
	{"the host's /tmp, /root, /home and shadow are invisible", func(t *testing.T, s *suite) {
		c := canary()
		f, err := os.CreateTemp("", "kiln-host-")
		if err != nil {
			t.Fatal(err)
		}
		f.WriteString(c)
		f.Close()
		defer os.Remove(f.Name())
		box := s.box(t)
		var r *resultView
		if s.opts.NoShell != "" {
			r = py(t, s, box, fmt.Sprintf("import os\nfor d in ('/tmp', '/root', '/home', '/etc'):\n    try:\n        print(d, os.listdir(d))\n    except OSError as e:\n        print(d, e.strerror)\nfor p in (%q, '/etc/shadow'):\n    try:\n        print(open(p).read())\n    except OSError as e:\n        print(e.strerror)", f.Name()))
		} else {
			r = sh(t, s, box, fmt.Sprintf("ls -la /tmp /root /home 2>&1; cat %s 2>/dev/null; cat /etc/shadow 2>&1; grep -rl %s /tmp /root /home /etc 2>/dev/null | head", f.Name(), c[:20]))
		}
		if strings.Contains(r.out, c) || strings.Contains(r.out, filepath.Base(f.Name())) {
			t.Errorf("host /tmp visible:\n%s", r.out)
		}
		if strings.Contains(r.out, "root:$") || strings.Contains(r.out, "root:*:") || strings.Contains(r.out, "root:!") {
			t.Errorf("/etc/shadow readable:\n%s", r.out)
		}
	}},
	{"root-only host files in the runtime are unreadable", func(t *testing.T, s *suite) {
		if os.Getuid() != 0 {
			t.Skip("needs root to plant a root-only file in /usr")
		}
		c := canary()
		p := filepath.Join("/usr/local/share", c)
		if err := os.WriteFile(p, []byte(c), 0o600); err != nil {
			t.Skipf("cannot plant %s: %v", p, err)
		}
		defer os.Remove(p)
		r := sh(t, s, s.box(t), "cat "+p+" 2>&1; ls -la /usr/local/share 2>&1 | head -3")
		if strings.Contains(r.Stdout.Text, c+"\n") || strings.HasPrefix(r.Stdout.Text, c) {
			t.Errorf("a root-only host file was read in the box:\n%s", r.out)
		}
	}},
	{"the host's loopback and other addresses are unreachable", func(t *testing.T, s *suite) {
		port := hostListener(t)
		code := fmt.Sprintf(`import socket
out = []
for host, port in [("127.0.0.1", %d), ("169.254.169.254", 80), ("10.0.0.1", 80), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((host, port)); out.append("OPEN %%s %%s" %% (host, s.recv(64)))
    except OSError as e:
        out.append("closed %%s" %% host)
try:
    socket.getaddrinfo("example.com", 80); out.append("DNS OPEN")
except OSError:
    out.append("dns closed")
print("\n".join(out))`, port)
		r := py(t, s, s.box(t), code)
		if r.Error != nil {
			t.Fatalf("probe failed: %+v", r.Error)
		}
		if strings.Contains(r.out, "OPEN") || strings.Contains(r.out, "HOST-SECRET") || !strings.Contains(r.out, "dns closed") {
			t.Errorf("network reachable:\n%s %+v", r.out, r.Error)
		}
	}},
	{"a fork bomb is contained and the backend still answers", func(t *testing.T, s *suite) {
		box := s.box(t)
		ctx := s.ctx(t, 30*time.Second)
		s.needShell(t)
		res, err := box.RunShell(ctx, "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", sandbox.ExecOptions{})
		if err == nil && res.ExitCode == 0 && strings.Contains(res.Stdout.Text, "survived") {
			t.Logf("the shell survived its bomb (pids limit held)")
		}
		box.Close()
		fresh := s.box(t)
		if r := py(t, s, fresh, "1 + 1"); r.value() != "2" {
			t.Errorf("after the bomb: %+v", r.ExecResult)
		}
	}},
	{"a memory bomb is killed and the box answers afterwards", func(t *testing.T, s *suite) {
		s.needMemoryLimit(t)
		box := s.box(t)
		const bomb = "x = bytearray(2 << 30)\nx[::4096] = b'1' * len(x[::4096])"
		if s.opts.MemoryBombKillsBox {
			res, err := box.RunPython(s.ctx(t, 60*time.Second), bomb, sandbox.ExecOptions{})
			switch {
			case err != nil && !errors.Is(err, sandbox.ErrDied):
				t.Fatalf("memory bomb: %v, want %v or an error result", err, sandbox.ErrDied)
			case err == nil && res.Error == nil:
				t.Fatalf("allocated 2 GiB under a %d MiB limit", s.opts.Limits.MemoryBytes>>20)
			}
			box.Close()
			box = s.box(t)
		} else if r := py(t, s, box, bomb); r.Error == nil {
			t.Fatalf("allocated 2 GiB under a %d MiB limit", s.opts.Limits.MemoryBytes>>20)
		}
		if r := py(t, s, box, "2 + 2"); r.value() != "4" {
			t.Errorf("after the memory bomb: %+v", r.ExecResult)
		}
	}},
	{"a disk fill stops at the workspace cap", func(t *testing.T, s *suite) {
		box := s.box(t)
		r := sh(t, s, box, "dd if=/dev/zero of=/work/fill bs=1M count=1024 2>&1")
		if r.ExitCode == 0 || !strings.Contains(r.out, "No space left") {
			t.Errorf("disk fill not refused: %s", r.out)
		}
		sh(t, s, box, "rm -f /work/fill")
		if r := sh(t, s, box, "echo ok > /work/after && cat /work/after"); r.Stdout.Text != "ok\n" {
			t.Errorf("after fill: %+v", r.ExecResult)
		}
	}},
	{"orphans are reaped and a command keeps its own exit status", func(t *testing.T, s *suite) {
		// Orphans re-parent to the box's PID 1, which must reap them (a
		// zombie holds a slot of the process limit) without taking the
		// status of a process the agent waits for itself. The control: a
		// zombie whose parent lives and does not wait is seen as one.
		s.needShell(t)
		box := s.box(t)
		// Polls, not sleeps: a fork in gVisor or a TCG guest is slow.
		r := sh(t, s, box, `zombies() { grep -l '^State:.Z' /proc/[0-9]*/status 2>/dev/null | wc -l; }
m=kiln-orph; alive() { grep -l "^${m}an" /proc/[0-9]*/cmdline 2>/dev/null | wc -l; }
poll() { for i in $(seq 200); do eval "$1" && return; sleep 0.1; done; }
sh -c 'sleep 0.2 & exec sleep 60' & holder=$!
poll '[ $(zombies) -ge 1 ]'; echo held=$(zombies)
kill $holder; wait $holder
for i in $(seq 20); do (exec -a "${m}an" sleep 1 &); done
echo ran=$(alive)
poll '[ $(alive) -eq 0 ]'; echo alive=$(alive)
poll '[ $(zombies) -eq 0 ]'; echo left=$(zombies)
exit 3`)
		if !strings.Contains(r.Stdout.Text, "held=") {
			t.Fatalf("no zombie count: %s", r.out)
		}
		if strings.Contains(r.Stdout.Text, "held=0\n") || strings.Contains(r.Stdout.Text, "ran=0\n") || !strings.Contains(r.Stdout.Text, "alive=0\n") {
			t.Fatalf("a zombie its parent holds is not seen, or the orphans never ran; the check is blind: %s", r.out)
		}
		if !strings.Contains(r.Stdout.Text, "left=0\n") {
			t.Errorf("orphans stay zombies: %s", r.out)
		}
		if r.ExitCode != 3 {
			t.Errorf("exit code %d, want 3: %+v", r.ExitCode, r.ExecResult)
		}
		// Orphans dying all the time while the agent waits for its own.
		sh(t, s, box, "setsid timeout 10 sh -c 'while :; do (true &); sleep 0.02; done' >/dev/null 2>&1 &")
		for i := 0; i < 10; i++ {
			if r := sh(t, s, box, fmt.Sprintf("true & exit %d", 40+i)); r.ExitCode != 40+i {
				t.Fatalf("amid dying orphans, exit code %d, want %d: %+v", r.ExitCode, 40+i, r.ExecResult)
			}
		}
		if r := py(t, s, box, "import subprocess\nsubprocess.run(['sh', '-c', 'exit 6']).returncode"); r.value() != "6" {
			t.Errorf("amid dying orphans, a subprocess's status: %q %+v", r.value(), r.Error)
		}
	}},
	{"no process outlives its box", func(t *testing.T, s *suite) {
		if !s.opts.HostProcesses {
			t.Skip("the backend's processes are not host processes")
		}
		marker := fmt.Sprint(3000000 + os.Getpid()%100000)
		box := s.box(t)
		sh(t, s, box, "(setsid sleep "+marker+" &) ; nohup sleep "+marker+" >/dev/null 2>&1 &")
		if len(leftovers("sleep\x00"+marker)) == 0 {
			t.Fatalf("the planted sleep is not visible on the host; the check is blind")
		}
		box.Close()
		deadline := time.Now().Add(s.timeout(5 * time.Second))
		for time.Now().Before(deadline) && len(leftovers("sleep\x00"+marker)) > 0 {
			time.Sleep(50 * time.Millisecond)
		}
		if l := leftovers("sleep\x00" + marker); len(l) > 0 {
			t.Errorf("processes outlived the box: %v", l)
		}
	}},
	{"file tools stay inside the workspace", func(t *testing.T, s *suite) {
		box := s.box(t)
		ctx := s.ctx(t, 30*time.Second)
		if err := box.WriteFile(ctx, "dir/sub/a.txt", []byte("payload")); err != nil {
			t.Fatal(err)
		}
		if r := py(t, s, box, "open('dir/sub/a.txt').read()"); r.value() != "'payload'" {
			t.Errorf("kernel reads written file: %q", r.value())
		}
		if s.opts.NoShell != "" {
			pyOK(t, s, box, "import os\nos.symlink('/etc/passwd', '/work/link'); os.symlink('/', '/work/rootlink'); os.symlink('../../..', '/work/dir/up')")
		} else {
			sh(t, s, box, "ln -s /etc/passwd /work/link; ln -s / /work/rootlink; ln -s ../../.. /work/dir/up")
		}
		for _, p := range []string{"/etc/passwd", "../etc/passwd", "link", "rootlink/etc/passwd", "dir/up/etc/passwd", "dir/../../etc/passwd", "a\x00b"} {
			if data, _, err := box.ReadFile(ctx, p, 0); err == nil {
				t.Errorf("read %q escaped: %q", p, data)
			}
			if err := box.WriteFile(ctx, p, []byte("x")); err == nil {
				t.Errorf("write %q escaped", p)
			}
		}
		if data, _, err := box.ReadFile(ctx, "/work/dir/sub/a.txt", 0); err != nil || string(data) != "payload" {
			t.Errorf("absolute path inside the workspace: %q %v", data, err)
		}
		files, err := box.ListFiles(ctx, "")
		if err != nil || len(files) == 0 {
			t.Errorf("list: %v %v", files, err)
		}
	}},
	{"files read from an offset, in pieces", func(t *testing.T, s *suite) {
		box := s.box(t)
		rr, ok := box.(sandbox.RangeReader)
		if !ok {
			t.Skip("this backend's boxes offer no ranged reads (sandbox.RangeReader)")
		}
		ctx := s.ctx(t, 60*time.Second)
		// Over agentproto.MaxRead: one read cannot carry it.
		const size = agentproto.MaxRead + 3<<20
		r := sh(t, s, box, fmt.Sprintf("head -c %d /dev/urandom > big.bin && sha256sum big.bin && ln -s /etc/passwd link", size))
		want, _, _ := strings.Cut(r.Stdout.Text, " ")
		if len(want) != 64 {
			t.Fatalf("sha256sum: %q", r.out)
		}
		h := sha256.New()
		var n int64
		for n < size {
			data, total, err := rr.ReadFileAt(ctx, "big.bin", n, 5<<20)
			if err != nil || total != size || len(data) == 0 {
				t.Fatalf("read at %d: %d bytes of %d, %v", n, len(data), total, err)
			}
			h.Write(data)
			n += int64(len(data))
		}
		if got := hex.EncodeToString(h.Sum(nil)); n != size || got != want {
			t.Errorf("read %d bytes with sha256 %s, want %d with %s", n, got, size, want)
		}
		if data, total, err := rr.ReadFileAt(ctx, "big.bin", size+10, 0); err != nil || len(data) != 0 || total != size {
			t.Errorf("read past the end: %d bytes, size %d, %v", len(data), total, err)
		}
		for _, p := range []string{"link", "/etc/passwd", "../etc/passwd"} {
			if data, _, err := rr.ReadFileAt(ctx, p, 1, 0); err == nil {
				t.Errorf("ranged read of %q escaped: %.40q", p, data)
			}
		}
	}},
	{"figures come back as PNG", func(t *testing.T, s *suite) {
		box := s.box(t)
		if r := py(t, s, box, "import importlib.util; importlib.util.find_spec('matplotlib') is not None"); r.value() != "True" {
			t.Skip("matplotlib is not installed in the box")
		}
		r := py(t, s, box, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()")
		if len(r.Displays) != 1 || !strings.HasPrefix(r.Displays[0]["image/png"], "iVBORw0KGgo") {
			t.Errorf("want one PNG display, got %d: %+v", len(r.Displays), r.Error)
		}
	}},
	{"two boxes draw different random numbers", twoBoxesDrawDifferently},
}
