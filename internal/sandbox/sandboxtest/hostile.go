package sandboxtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// LeakChecker is implemented by backends that can list what a destroyed box
// may have left on the host: processes, cgroups, mounts, state directories
// or VMs. The hostile battery calls it after every case, when none of the
// suite's boxes is open, and wants an empty list.
type LeakChecker interface {
	Leftovers() []string
}

// hostileCase is one payload of the battery. holds says, in words, what must
// be true afterwards; fn checks the payload's own effects. After every case
// the battery also checks that the backend still makes a working box and
// that nothing of the case's boxes outlives them.
type hostileCase struct {
	name  string
	holds string
	fn    func(t *testing.T, s *suite)
}

// hostile is the battery: model code that tries to read the host, reach it,
// leave the box, exhaust the host, persist across boxes, or abuse the file
// tools.
var hostile = []hostileCase{
	// Reading the host.
	{"read the server's environment", "no variable of the server's environment is visible anywhere in the box", func(t *testing.T, s *suite) {
		c := canary()
		t.Setenv("KILN_HOSTILE_SECRET", c)
		box := s.box(t)
		r := sh(t, s, box, "env; for f in /proc/1/environ /proc/self/environ /proc/*/environ /proc/*/task/*/environ; do cat $f 2>/dev/null | tr '\\0' '\\n'; done; cat /proc/1/cmdline 2>/dev/null | tr '\\0' ' '")
		if strings.Contains(r.out, c) || strings.Contains(r.out, "KILN_HOSTILE_SECRET") {
			t.Errorf("the server's environment is visible in the box")
		}
		r = py(t, s, box, "import os\n[k for k in os.environ if 'HOSTILE' in k]")
		if r.value() != "[]" {
			t.Errorf("kernel environment: %s", r.value())
		}
	}},
	{"read the host's /tmp, /root, /home and shadow files", "no planted host file is readable or listed", func(t *testing.T, s *suite) {
		c := canary()
		var planted []string
		for _, dir := range []string{os.TempDir(), "/root", "/home", "/var/tmp"} {
			p := filepath.Join(dir, "kiln-hostile-"+c[12:])
			if os.WriteFile(p, []byte(c), 0o644) == nil {
				planted = append(planted, p)
				t.Cleanup(func() { os.Remove(p) })
			}
		}
		if len(planted) == 0 {
			t.Skip("cannot plant files on the host")
		}
		cmd := "cat " + strings.Join(planted, " ") + " 2>/dev/null; ls -la / /tmp /root /home /var/tmp 2>/dev/null; cat /etc/shadow /etc/gshadow /etc/sudoers 2>&1; find / -xdev -name 'kiln-hostile-*' 2>/dev/null | head"
		r := sh(t, s, s.box(t), cmd)
		if strings.Contains(r.out, c) || strings.Contains(r.out, "kiln-hostile-"+c[12:]) {
			t.Errorf("a host file is visible:\n%s", r.out)
		}
		if shadowLine(r.out) {
			t.Errorf("a shadow file is readable:\n%s", r.out)
		}
	}},
	{"read the kiln binary, its agent on the host and its config", "the server's executable and config are neither readable nor reachable through /proc", func(t *testing.T, s *suite) {
		exe, err := os.Executable()
		if err != nil {
			t.Skip(err)
		}
		c := canary()
		cfgDir := ""
		if d, err := os.UserConfigDir(); err == nil {
			cfgDir = filepath.Join(d, "kiln")
			if os.MkdirAll(cfgDir, 0o700) == nil {
				p := filepath.Join(cfgDir, "hostile-"+c[12:]+".toml")
				if os.WriteFile(p, []byte("token = \""+c+"\"\n"), 0o600) == nil {
					t.Cleanup(func() { os.Remove(p) })
				}
			}
		}
		box := s.box(t)
		r := sh(t, s, box, fmt.Sprintf("head -c 4 %q 2>/dev/null | od -c | head -1; ls -la %q %q 2>/dev/null; cat %q/* 2>/dev/null; for p in /proc/[0-9]*; do readlink $p/exe $p/cwd $p/root $p/fd/* 2>/dev/null; done | sort -u",
			exe, filepath.Dir(exe), cfgDir, cfgDir))
		if strings.Contains(r.out, "E   L   F") || strings.Contains(r.out, c) {
			t.Errorf("the server's binary or config is readable:\n%s", r.out)
		}
		for _, line := range strings.Split(r.Stdout.Text, "\n") {
			if strings.Contains(line, filepath.Base(exe)) || strings.Contains(line, "kiln-jail") || strings.Contains(line, "go-build") {
				t.Errorf("a host path is reachable through /proc: %s", line)
			}
		}
	}},
	{"read another box's workspace, /tmp and processes", "a second box sees none of the first box's files or processes", func(t *testing.T, s *suite) {
		c := canary()
		a, b := s.box(t), s.box(t)
		if s.opts.NoShell != "" {
			pyOK(t, s, a, fmt.Sprintf("open('/work/secret', 'w').write(%q); open('/tmp/secret', 'w').write(%q)", c, c))
			r := py(t, s, b, "import os\nfor p in ('/work/secret', '/tmp/secret'):\n    try:\n        print(open(p).read())\n    except OSError as e:\n        print(e.strerror)\nprint(os.listdir('/work'), os.listdir('/tmp'))")
			if strings.Contains(r.out, c) {
				t.Errorf("the second box sees the first's files:\n%s", r.out)
			}
			return
		}
		sh(t, s, a, fmt.Sprintf("echo %s > /work/secret; echo %s > /tmp/secret; echo %s > /dev/shm/secret 2>/dev/null; (exec -a other-%s sleep 600 >/dev/null 2>&1 &)", c, c, c, hostileMarker))
		r := sh(t, s, b, fmt.Sprintf("cat /work/secret /tmp/secret /dev/shm/secret 2>&1; grep -rs '%s[%s]' /work /tmp /dev/shm 2>/dev/null | head; cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '", c[:len(c)-1], c[len(c)-1:]))
		if strings.Contains(r.out, c) || strings.Contains(r.out, "other-"+hostileMarker) {
			t.Errorf("the second box sees the first's files or processes:\n%s", r.out)
		}
	}},

	// Reaching the host.
	{"signal and ptrace host processes", "a host process survives kill -9 of every pid and kill(-1); ptrace is refused", func(t *testing.T, s *suite) {
		s.needOS(t)
		victim := hostVictim(t, s)
		box := s.box(t)
		r := py(t, s, box, fmt.Sprintf(`import os, signal, ctypes
libc = ctypes.CDLL(None, use_errno=True)
hits = []
for pid in list(range(1, 70000)) + [%d]:
    if pid in (os.getpid(), 1):
        continue
    try:
        os.kill(pid, 0)
        hits.append(pid)
    except OSError:
        pass
traced = libc.ptrace(16, %d, 0, 0) == 0 or libc.ptrace(16, 1, 0, 0) == 0
(len(hits), traced)`, victim.Process.Pid, victim.Process.Pid))
		if r.Error != nil {
			t.Fatalf("probe: %+v", r.Error)
		}
		if !strings.HasSuffix(r.value(), "False)") {
			t.Errorf("ptrace attached: %s", r.value())
		}
		if n, _ := strconv.Atoi(strings.Trim(strings.Split(r.value(), ",")[0], "(")); n > s.opts.Limits.Pids {
			t.Errorf("the box can signal %d processes: it sees more than its own", n)
		}
		// kill(-1) reaches every process the box may signal: only its own.
		s.needShell(t)
		res, err := box.RunShell(s.ctx(t, 30*time.Second), fmt.Sprintf("kill -9 %d; kill -9 -1", victim.Process.Pid), sandbox.ExecOptions{})
		t.Logf("kill -1: %v %v", res != nil, err)
		if err := victim.Process.Signal(syscallZero); err != nil {
			t.Errorf("the host victim died: %v", err)
		}
	}},
	{"see the host's process table", "the box's /proc lists only its own processes", func(t *testing.T, s *suite) {
		victim := hostVictim(t, s)
		r := sh(t, s, s.box(t), "ls -d /proc/[0-9]* | wc -l; cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; ps -e 2>/dev/null | wc -l")
		if strings.Contains(r.out, "victim-"+hostileMarker) {
			t.Errorf("host process %d is visible in the box:\n%s", victim.Process.Pid, r.out)
		}
		if n, _ := strconv.Atoi(strings.TrimSpace(strings.SplitN(r.Stdout.Text, "\n", 2)[0])); n > 20 {
			t.Errorf("the box sees %d processes", n)
		}
	}},
	{"write outside the workspace", "writes to /, /etc, /usr, /bin, the agent and /proc fail and the host is unchanged", func(t *testing.T, s *suite) {
		c := canary()
		targets := []string{"/kiln-" + c, "/etc/kiln-" + c, "/usr/kiln-" + c, "/usr/bin/kiln-" + c, "/bin/kiln-" + c, "/root/kiln-" + c, "/var/kiln-" + c, "/.kiln/kiln-" + c, "/proc/kiln-" + c}
		var cmd strings.Builder
		for _, p := range targets {
			fmt.Fprintf(&cmd, "echo x > %s 2>/dev/null && echo WROTE %s; ", p, p)
		}
		cmd.WriteString("echo x >> /.kiln/kiln-agent 2>/dev/null && echo WROTE agent; touch /usr/bin/python3 2>/dev/null && echo WROTE python; chmod 777 /etc 2>/dev/null && echo WROTE chmod; true")
		box := s.box(t)
		r := sh(t, s, box, cmd.String())
		if strings.Contains(r.out, "WROTE") {
			t.Errorf("wrote outside the workspace:\n%s", r.out)
		}
		for _, p := range targets {
			if _, err := os.Lstat(p); err == nil {
				os.Remove(p)
				t.Errorf("%s appeared on the host", p)
			}
		}
	}},
	{"mount, unshare, setns and chroot", "every namespace and mount operation is refused", func(t *testing.T, s *suite) {
		s.needOS(t)
		r := py(t, s, s.box(t), `import os, ctypes
libc = ctypes.CDLL(None, use_errno=True)
ok = []
def try_(name, f):
    try:
        if f() in (0, None):
            ok.append(name)
    except OSError:
        pass
try_("mount tmpfs", lambda: libc.mount(b"none", b"/work", b"tmpfs", 0, None))
try_("mount proc", lambda: libc.mount(b"proc", b"/tmp", b"proc", 0, None))
try_("bind /", lambda: libc.mount(b"/", b"/tmp", None, 4096, None))
for flag in (0x10000000, 0x00020000, 0x40000000, 0x20000000, 0x02000000, 0x08000000, 0x04000000):
    try_("unshare %x" % flag, lambda: libc.unshare(flag))
fd = os.open("/proc/1/ns/mnt", os.O_RDONLY) if os.path.exists("/proc/1/ns/mnt") else -1
if fd >= 0:
    try_("setns", lambda: libc.setns(fd, 0))
try_("chroot", lambda: os.chroot("/tmp"))
try_("pivot_root", lambda: libc.syscall(155, b"/tmp", b"/tmp"))
try_("open_tree", lambda: 0 if libc.syscall(428, -100, b"/", 1) >= 0 else -1)
try_("fsopen", lambda: 0 if libc.syscall(430, b"tmpfs", 0) >= 0 else -1)
ok`)
		if r.value() != "[]" {
			t.Errorf("allowed in the box: %s %+v", r.value(), r.Error)
		}
		// The python kernel is threaded, where unshare(CLONE_NEWUSER)
		// fails anyway: try again from single-threaded tools. A user
		// namespace alone is the backend's business (gVisor's sentry
		// implements them itself); a mount namespace or a mount is not.
		r = sh(t, s, s.box(t), "unshare -r id 2>&1; unshare -m true 2>&1 && echo UNSHARED; mount -t tmpfs none /tmp 2>&1 && echo MOUNTED; true")
		if strings.Contains(r.out, "UNSHARED") || strings.Contains(r.out, "MOUNTED") {
			t.Errorf("tools allowed in the box:\n%s", r.out)
		}
		if strings.Contains(r.out, "uid=0") {
			t.Logf("the backend lets the box create a user namespace:\n%s", r.out)
		}
	}},
	{"load a kernel module", "init_module, finit_module and modprobe fail; the host's module list is unchanged", func(t *testing.T, s *suite) {
		s.needOS(t)
		before, _ := os.ReadFile("/proc/modules")
		r := py(t, s, s.box(t), `import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open("/dev/null", os.O_RDONLY)
(libc.syscall(313, fd, b"", 0), libc.syscall(175, b"\x7fELF" + b"\0" * 60, 64, b""), libc.syscall(176, b"loop", 0))`)
		if r.value() != "(-1, -1, -1)" {
			t.Errorf("module syscalls: %s %+v", r.value(), r.Error)
		}
		sh(t, s, s.box(t), "modprobe dummy 2>&1; insmod /lib/modules/*/kernel/drivers/net/dummy.ko 2>&1; true")
		if after, _ := os.ReadFile("/proc/modules"); moduleNames(after) != moduleNames(before) {
			t.Errorf("the host's modules changed")
		}
	}},
	{"open raw and packet sockets", "raw, packet and netlink-audit sockets are refused", func(t *testing.T, s *suite) {
		r := py(t, s, s.box(t), `import socket
ok = []
for name, args in [("raw icmp", (socket.AF_INET, socket.SOCK_RAW, 1)), ("raw tcp", (socket.AF_INET, socket.SOCK_RAW, 6)),
                   ("raw6", (socket.AF_INET6, socket.SOCK_RAW, 58)), ("packet", (17, socket.SOCK_RAW, 0x0300)),
                   ("packet dgram", (17, socket.SOCK_DGRAM, 0x0300))]:
    try:
        socket.socket(*args).close(); ok.append(name)
    except OSError:
        pass
ok`)
		if r.value() != "[]" {
			t.Errorf("opened in the box: %s %+v", r.value(), r.Error)
		}
	}},
	{"write /proc/sys, /proc/sysrq-trigger and /sys", "every write fails; the host's hostname and core_pattern are unchanged", func(t *testing.T, s *suite) {
		host, _ := os.Hostname()
		core, _ := os.ReadFile("/proc/sys/kernel/core_pattern")
		r := sh(t, s, s.box(t), `for f in /proc/sys/kernel/hostname /proc/sys/kernel/core_pattern /proc/sys/vm/drop_caches /proc/sys/kernel/panic /proc/sys/net/ipv4/ip_forward /proc/sysrq-trigger /sys/kernel/uevent_helper /sys/power/state /proc/self/oom_score_adj; do
  (echo 1 > $f) 2>/dev/null && echo "WROTE $f"
done
(echo -1000 > /proc/self/oom_score_adj) 2>/dev/null && echo "WROTE oom_score_adj"; true`)
		for _, line := range strings.Split(r.Stdout.Text, "\n") {
			if strings.HasPrefix(line, "WROTE") && !strings.Contains(line, "oom_score_adj") {
				t.Errorf("%s", line)
			}
			if line == "WROTE oom_score_adj" && s.opts.HostProcesses {
				t.Errorf("the box lowered its OOM score below the default")
			}
		}
		if h, _ := os.Hostname(); h != host {
			t.Errorf("the host's hostname changed to %q", h)
		}
		if c, _ := os.ReadFile("/proc/sys/kernel/core_pattern"); !bytes.Equal(c, core) {
			t.Errorf("the host's core_pattern changed to %q", c)
		}
	}},
	{"make and open device nodes", "mknod fails, no block device is visible, and host memory, kmsg and disks cannot be opened", func(t *testing.T, s *suite) {
		r := sh(t, s, s.box(t), `mknod /tmp/mem c 1 1 2>/dev/null && echo MADE mem; mknod /work/sda b 8 0 2>/dev/null && echo MADE sda
find / -xdev -type b 2>/dev/null | sed 's/^/BLOCK /'
for d in /dev/mem /dev/kmem /dev/port /dev/kmsg /dev/sda /dev/vda /dev/nvme0n1 /dev/console /dev/tty1 /dev/fuse /dev/kvm /dev/net/tun; do
  (head -c 1 $d >/dev/null) 2>/dev/null && echo "OPENED $d"
done; true`)
		for _, w := range []string{"MADE", "BLOCK", "OPENED"} {
			if strings.Contains(r.out, w) {
				t.Errorf("device access in the box:\n%s", r.out)
				break
			}
		}
	}},

	// Leaving the box under the default policy.
	{"reach the network: host loopback, metadata, private, public, DNS", "no connection reaches any host listener and nothing resolves", func(t *testing.T, s *suite) {
		var accepted atomic.Int64
		port := countingListener(t, "tcp4", "0.0.0.0:0", &accepted)
		port6 := countingListener(t, "tcp6", "[::1]:0", &accepted)
		targets := []string{"127.0.0.1", "169.254.169.254", "10.0.0.1", "172.16.0.1", "192.168.0.1", "100.64.0.1", "1.1.1.1", "8.8.8.8"}
		targets = append(targets, hostAddrs()...)
		var py6 strings.Builder
		for _, h := range targets {
			fmt.Fprintf(&py6, "probe(%q, %d)\n", h, port)
		}
		code := fmt.Sprintf(`import socket
out = []
def probe(host, port, fam=socket.AF_INET):
    for p in (port, 80, 443, 53):
        try:
            s = socket.socket(fam); s.settimeout(1)
        except OSError:
            continue
        try:
            s.connect((host, p)); out.append("OPEN %%s:%%d" %% (host, p))
        except OSError:
            pass
        finally:
            s.close()
%sprobe("::1", %d, socket.AF_INET6)
probe("2001:4860:4860::8888", 443, socket.AF_INET6)
for ns in ("8.8.8.8", "1.1.1.1", "127.0.0.53", "169.254.169.254"):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(1)
    try:
        u.sendto(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01", (ns, 53))
        u.recvfrom(512); out.append("DNS ANSWER %%s" %% ns)
    except OSError:
        pass
for name in ("example.com", "metadata.google.internal", "kiln-hostile.invalid"):
    try:
        socket.getaddrinfo(name, 80); out.append("RESOLVED %%s" %% name)
    except OSError:
        pass
out`, py6.String(), port6)
		r := py(t, s, s.box(t), code)
		if r.Error != nil {
			t.Fatalf("probe: %+v", r.Error)
		}
		if r.value() != "[]" {
			t.Errorf("the network is reachable: %s", r.value())
		}
		if n := accepted.Load(); n > 0 {
			t.Errorf("host listeners accepted %d connections from the box", n)
		}
	}},

	// Exhausting the host.
	{"fork bomb in python", "forks stop at the pids limit and the box is destroyed with its children", func(t *testing.T, s *suite) {
		box := s.box(t)
		res, err := box.RunPython(s.ctx(t, 60*time.Second), fmt.Sprintf(`import os, time
n = 0
for i in range(10000):
    try:
        if os.fork() == 0:
            try:
                os.execvp("sleep", ["bomb-%s", "600"])
            finally:
                os._exit(0)
        n += 1
    except OSError:
        break
n`, hostileMarker), sandbox.ExecOptions{})
		if errors.Is(err, sandbox.ErrDied) {
			// At the pids limit the agent itself may fail to start a
			// thread and die: the box is lost, not the host.
			t.Logf("the box died at its pids limit")
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		r := view(res)
		if n, err := strconv.Atoi(r.value()); err != nil || n > s.opts.Limits.Pids {
			t.Errorf("forked %q times under a pids limit of %d (%+v)", r.value(), s.opts.Limits.Pids, r.Error)
		}
	}},
	{"memory bomb in many processes", "the box is killed or refused, and the backend still answers", func(t *testing.T, s *suite) {
		s.needMemoryLimit(t)
		box := s.box(t)
		mib := s.opts.Limits.MemoryBytes >> 20
		s.needShell(t)
		res, err := box.RunShell(s.ctx(t, 60*time.Second), fmt.Sprintf("for i in 1 2 3 4; do python3 -c 'b = bytearray(%d << 20); b[::4096] = b\"1\" * len(b[::4096]); import time; time.sleep(2)' & done; sleep 1; wait; echo done", mib/2), sandbox.ExecOptions{})
		if err != nil && !errors.Is(err, sandbox.ErrDied) {
			t.Errorf("the call failed: %v", err)
		}
		if err == nil && res.ExitCode == 0 && strings.Contains(res.Stdout.Text, "done") && !strings.Contains(res.Stderr.Text, "MemoryError") && !strings.Contains(res.Stderr.Text, "Killed") {
			t.Logf("four processes of %d MiB each lived under a %d MiB limit? %+v", mib/2, mib, res)
		}
	}},
	{"disk fill of /tmp and /dev/shm", "writes stop at their caps with ENOSPC", func(t *testing.T, s *suite) {
		box := s.box(t)
		r := sh(t, s, box, "dd if=/dev/zero of=/tmp/fill bs=1M count=2048 2>&1; dd if=/dev/zero of=/dev/shm/fill bs=1M count=2048 2>&1; rm -f /tmp/fill /dev/shm/fill; echo ok > /tmp/after && cat /tmp/after")
		if strings.Count(r.out, "No space left") < 2 || !strings.HasSuffix(r.Stdout.Text, "ok\n") {
			t.Errorf("fill not capped:\n%s", r.out)
		}
	}},
	{"inode fill with a million tiny files", "file creation stops at the inode cap and the file tools still answer", func(t *testing.T, s *suite) {
		box := s.box(t)
		// Without an inode cap (gVisor's tmpfs takes no nr_inodes) it is
		// the memory limit that ends the fill, once the files' dentries
		// fill it: 55 s of file creation on a busy 2-core host, so such a
		// backend gets three times the time.
		fill := 60 * time.Second
		if s.opts.NoInodeCap != "" {
			fill *= 3
		}
		res, err := box.RunPython(s.ctx(t, fill), `import os
os.mkdir("many")
n = 0
try:
    for n in range(1000000):
        open("many/%d" % n, "w").close()
except OSError as e:
    err = e.errno
n`, sandbox.ExecOptions{})
		if errors.Is(err, sandbox.ErrDied) && s.opts.MemoryBombKillsBox {
			// No inode cap (runsc passes no nr_inodes to gVisor's tmpfs),
			// but the memory limit ended the box; afterwards checks that a
			// new box works.
			t.Logf("the box died filling inodes (no inode cap; its memory limit held)")
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.Atoi(view(res).value())
		if n >= 999999 {
			t.Errorf("created a million files: no inode cap")
		}
		ctx := s.ctx(t, 60*time.Second)
		files, err := box.ListFiles(ctx, "many")
		if err != nil || len(files) == 0 || len(files) > 1000 {
			t.Errorf("list after the fill: %d entries, %v", len(files), err)
		}
		if _, err := box.Changes(ctx, time.Time{}); err != nil {
			t.Errorf("changes after the fill: %v", err)
		}
	}},
	{"CPU spin on every core", "the backend makes and serves another box while the spin runs, and the spinners die with their box", func(t *testing.T, s *suite) {
		spinner := s.box(t)
		sh(t, s, spinner, fmt.Sprintf("for i in $(seq %d); do (exec -a spin-%s bash -c 'while :; do :; done' >/dev/null 2>&1 &) ; done; echo started", 2*runtimeCPUs(), hostileMarker))
		other := s.box(t)
		if r := py(t, s, other, "sum(range(1000))"); r.value() != "499500" {
			t.Errorf("beside the spin: %+v", r.ExecResult)
		}
		spinner.Close()
	}},
	{"output flood on both streams", "the result keeps at most the cap and counts every byte", func(t *testing.T, s *suite) {
		box := s.box(t)
		const total = 50_000_000
		s.needShell(t)
		res, err := box.RunShell(s.ctx(t, 60*time.Second), fmt.Sprintf("head -c %d /dev/zero | tr '\\0' o & head -c %d /dev/zero | tr '\\0' e >&2; wait", total, total), sandbox.ExecOptions{MaxOutput: 10000})
		if err != nil {
			t.Fatal(err)
		}
		for _, st := range []agentproto.Stream{res.Stdout, res.Stderr} {
			if len(st.Text) > 10000 || st.Total != total {
				t.Errorf("stream kept %d bytes and counted %d of %d", len(st.Text), st.Total, total)
			}
		}
	}},
	{"a huge single line without newline", "python output of 30 MB in one write is capped and the kernel answers afterwards", func(t *testing.T, s *suite) {
		box := s.box(t)
		res, err := box.RunPython(s.ctx(t, 60*time.Second), "import sys\nsys.stdout.write('y' * 30_000_000)\nsys.stderr.write('z' * 5_000_000)\n'x' * 3_000_000", sandbox.ExecOptions{MaxOutput: 10000})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Stdout.Text) > 10000 || res.Stdout.Total != 30_000_000 || len(res.Stderr.Text) > 10000 {
			t.Errorf("stdout kept %d counted %d; stderr kept %d", len(res.Stdout.Text), res.Stdout.Total, len(res.Stderr.Text))
		}
		if n := len(res.Result["text/plain"]); n > agentproto.MaxFrame {
			t.Errorf("result of %d bytes", n)
		}
		if r := py(t, s, box, "1 + 2"); r.value() != "3" {
			t.Errorf("kernel after the line: %+v", r.ExecResult)
		}
	}},
	{"a process that ignores SIGTERM, SIGINT and SIGHUP", "it dies with its box", func(t *testing.T, s *suite) {
		box := s.box(t)
		sh(t, s, box, fmt.Sprintf("(trap '' TERM INT HUP; exec -a stubborn-%s sleep 600) >/dev/null 2>&1 & disown; echo planted", hostileMarker))
		s.mustSee(t, "stubborn-"+hostileMarker)
		box.Interrupt(s.ctx(t, 10*time.Second))
		box.Close()
	}},
	{"orphaned grandchildren in a new session", "double-forked daemons die with their box", func(t *testing.T, s *suite) {
		box := s.box(t)
		py(t, s, box, fmt.Sprintf(`import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["orphan-%s", "600"])
    os._exit(0)
os.wait()
"parent done"`, hostileMarker))
		s.mustSee(t, "orphan-"+hostileMarker)
		box.Close()
	}},
	{"a sleeping child left behind at the end of a per-call run", "the call returns, and the child dies when the box is destroyed", func(t *testing.T, s *suite) {
		box := s.box(t)
		s.needShell(t)
		res, err := box.RunShell(s.ctx(t, 30*time.Second), fmt.Sprintf("(exec -a leftover-%s sleep 600) & echo returned", hostileMarker), sandbox.ExecOptions{})
		if err != nil || !strings.Contains(res.Stdout.Text, "returned") {
			t.Fatalf("the call did not return: %v %+v", err, res)
		}
		s.mustSee(t, "leftover-"+hostileMarker)
		box.Close()
	}},
	{"kill -1 from inside the box", "the box takes down only itself; the call fails cleanly and the backend answers", func(t *testing.T, s *suite) {
		victim := hostVictim(t, s)
		box := s.box(t)
		s.needShell(t)
		res, err := box.RunShell(s.ctx(t, 30*time.Second), "kill -9 -1; sleep 5; echo alive", sandbox.ExecOptions{})
		if err != nil && !errors.Is(err, sandbox.ErrDied) {
			t.Errorf("unclear error: %v", err)
		}
		t.Logf("kill -1: %+v %v", res, err)
		if err := victim.Process.Signal(syscallZero); err != nil {
			t.Errorf("the host victim died: %v", err)
		}
	}},

	// Persistence between boxes.
	{"persistence from one per-call box to the next", "files, processes, environment and start-up hooks planted by one box are absent from the next", func(t *testing.T, s *suite) {
		c := canary()
		first := s.box(t)
		sh(t, s, first, fmt.Sprintf(`echo %[1]s > /work/planted; echo %[1]s > /tmp/planted; echo %[1]s > /dev/shm/planted 2>/dev/null
echo 'export PLANTED=%[1]s' >> ~/.bashrc; echo 'export PLANTED=%[1]s' >> ~/.profile
mkdir -p ~/.local/lib/python3/site-packages ~/.ipython; echo 'import os; os.environ["PLANTED"]="%[1]s"' > ~/.local/lib/python3/site-packages/usercustomize.py
(exec -a planted-%[2]s sleep 600 >/dev/null 2>&1 &)`, c, hostileMarker))
		py(t, s, first, "import os; os.environ['PLANTED'] = '"+c+"'")
		first.Close()
		second := s.box(t)
		r := sh(t, s, second, "cat /work/planted /tmp/planted /dev/shm/planted ~/.bashrc ~/.profile 2>/dev/null; env; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
		if strings.Contains(r.out, c) || strings.Contains(r.out, "planted-"+hostileMarker) {
			t.Errorf("the second box sees what the first planted:\n%s", r.out)
		}
		if r := py(t, s, second, "import os; os.environ.get('PLANTED', '')"); r.value() != "''" {
			t.Errorf("the kernel inherited %s", r.value())
		}
	}},

	// The file tools.
	{"file tools: absolute paths, .., and planted symlinks", "no read, write or list leaves the workspace, whatever links the box planted", func(t *testing.T, s *suite) {
		box := s.box(t)
		ctx := s.ctx(t, 60*time.Second)
		if s.opts.NoShell != "" {
			pyOK(t, s, box, `import os
os.chdir("/work"); os.makedirs("d/e")
for target, name in [("/etc/passwd", "abs"), ("../../../../etc/passwd", "d/e/rel"), ("/", "root"), ("/proc/1/environ", "env"),
        ("/proc/self/root", "selfroot"), ("loop1", "loop2"), ("loop2", "loop1"), ("/tmp", "tmp"), ("/dev/zero", "zero"),
        ("/dev/stdin", "stdin"), ("..", "d/up"), ("/work/../etc", "dotdot")]:
    os.symlink(target, name)
if hasattr(os, "mkfifo"):
    os.mkfifo("fifo")
else:
    os.mkdir("fifo")  # no FIFOs here; a directory must refuse the write too
open("/tmp/outside", "w").write("secret\n")`)
		} else {
			sh(t, s, box, `cd /work; mkdir -p d/e; ln -s /etc/passwd abs; ln -s ../../../../etc/passwd d/e/rel; ln -s / root; ln -s /proc/1/environ env
ln -s /proc/self/root selfroot; ln -s loop1 loop2; ln -s loop2 loop1; ln -s /tmp tmp; ln -s /dev/zero zero; ln -s /dev/stdin stdin
mkfifo fifo; ln -s .. d/up; ln -s /work/../etc dotdot; echo secret > /tmp/outside`)
		}
		paths := []string{"/etc/passwd", "/work/../etc/passwd", "../etc/passwd", "d/../../etc/passwd", "abs", "d/e/rel", "root/etc/passwd",
			"env", "selfroot/etc/passwd", "loop1", "tmp/outside", "zero", "stdin", "fifo", "d/up/../etc/passwd", "dotdot/passwd",
			"/proc/self/environ", "/tmp/outside", "//etc/passwd", "/work/./../tmp/outside", "./../tmp/outside", "d/e/rel/x"}
		for _, p := range paths {
			readCtx, cancel := context.WithTimeout(ctx, s.timeout(10*time.Second))
			data, _, err := box.ReadFile(readCtx, p, 1<<20)
			cancel()
			if err == nil {
				t.Errorf("read %q: %q", p, truncate(data))
			}
			if errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("read %q hung", p)
			}
		}
		for _, p := range []string{"/etc/kiln-x", "../x", "abs", "root/tmp/x", "d/up/../x", "tmp/x", "d/e/rel", "loop1", "zero", "fifo"} {
			writeCtx, cancel := context.WithTimeout(ctx, s.timeout(10*time.Second))
			err := box.WriteFile(writeCtx, p, []byte("overwritten"))
			cancel()
			if err == nil && !strings.HasPrefix(p, "d/up") {
				t.Errorf("write %q succeeded", p)
			}
			if errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("write %q hung", p)
			}
		}
		for _, p := range []string{"root", "tmp", "d/up", "/", "..", "/etc", "selfroot"} {
			files, err := box.ListFiles(ctx, p)
			for _, f := range files {
				if strings.Contains(f.Path, "passwd") || strings.Contains(f.Path, "outside") {
					t.Errorf("list %q shows %s", p, f.Path)
				}
			}
			_ = err
		}
		var r *resultView
		if s.opts.NoShell != "" {
			r = py(t, s, box, "print(open('/tmp/outside').read(), end='')")
		} else {
			r = sh(t, s, box, "cat /tmp/outside; head -c 20 /etc/passwd | head -1")
		}
		if !strings.HasPrefix(r.Stdout.Text, "secret\n") {
			t.Errorf("a file outside the workspace changed: %q", r.Stdout.Text)
		}
	}},
	{"file tools: hard links planted in the workspace", "hard links to files outside the workspace cannot be made, and writes through links stay inside", func(t *testing.T, s *suite) {
		box := s.box(t)
		ctx := s.ctx(t, 30*time.Second)
		r := sh(t, s, box, "cd /work; echo inside > a; ln a hl; ln /etc/passwd passwd 2>&1 && echo LINKED; ln /tmp/x tmpx 2>&1; ln /.kiln/kiln-agent agent 2>&1 && echo LINKED; echo outside > /tmp/x; ln /tmp/x tmpx 2>&1 && echo LINKED; true")
		if strings.Contains(r.out, "LINKED") {
			t.Errorf("a hard link across the workspace boundary:\n%s", r.out)
		}
		if err := box.WriteFile(ctx, "hl", []byte("changed")); err != nil {
			t.Errorf("write through an inside hard link: %v", err)
		}
		if data, _, err := box.ReadFile(ctx, "passwd", 0); err == nil && strings.Contains(string(data), "root:") {
			t.Errorf("read /etc/passwd through a hard link")
		}
	}},
	{"file tools: long paths, NUL bytes, invalid UTF-8 and deep trees", "each is refused or handled with a clear error, and the agent keeps answering", func(t *testing.T, s *suite) {
		box := s.box(t)
		ctx := s.ctx(t, 60*time.Second)
		bad := []string{strings.Repeat("a", 256), strings.Repeat("a/", 2100) + "f", strings.Repeat("x", 70000), "a\x00b", "\x00", "ok/\x00/../x"}
		for _, p := range bad {
			if err := box.WriteFile(ctx, p, []byte("x")); err == nil {
				t.Errorf("write %q accepted", truncate([]byte(p)))
			}
			if _, _, err := box.ReadFile(ctx, p, 0); err == nil {
				t.Errorf("read %q accepted", truncate([]byte(p)))
			}
			if _, err := box.ListFiles(ctx, p); err == nil {
				t.Errorf("list %q accepted", truncate([]byte(p)))
			}
		}
		// Invalid UTF-8 names: either refused or round-tripped; never a fault.
		for _, p := range []string{"bad\xff\xfe.txt", "\xc0\xaf..\xc0\xaf", "ok\u202e.txt"} {
			err := box.WriteFile(ctx, p, []byte("\xff\x00binary"))
			if err != nil {
				var ae *sandbox.AgentError
				if !errors.As(err, &ae) {
					t.Errorf("write %q: not a clear refusal: %v", p, err)
				}
				continue
			}
			if data, _, err := box.ReadFile(ctx, p, 0); err != nil || string(data) != "\xff\x00binary" {
				t.Errorf("read back %q: %q %v", p, data, err)
			}
		}
		// A tree deeper than any path the tools accept, and names the
		// kernel returns as bytes.
		sh(t, s, box, "cd /work; python3 -c 'import os; [(os.mkdir(\"d\"), os.chdir(\"d\")) for i in range(600)]; open(\"deep\", \"w\").write(\"x\")'; touch \"$(printf 'raw\\377name')\"")
		if _, err := box.ListFiles(ctx, ""); err != nil {
			t.Errorf("list a deep tree: %v", err)
		}
		if r := py(t, s, box, "6 * 7"); r.value() != "42" {
			t.Errorf("agent after bad paths: %+v", r.ExecResult)
		}
	}},
	{"file tools: huge files", "writes over the protocol cap or the workspace are refused, and huge reads are capped", func(t *testing.T, s *suite) {
		box := s.box(t)
		ctx := s.ctx(t, 120*time.Second)
		if err := box.WriteFile(ctx, "big", make([]byte, 33<<20)); err == nil {
			t.Errorf("a 33 MiB write was accepted")
		}
		if err := box.WriteFile(ctx, "fits", make([]byte, s.opts.Limits.WorkspaceBytes+1)); err == nil {
			t.Errorf("a write larger than the workspace was accepted")
		}
		sh(t, s, box, fmt.Sprintf("rm -f /work/*; head -c %d /dev/urandom > /work/huge 2>/dev/null; true", s.opts.Limits.WorkspaceBytes*3/4))
		data, size, err := box.ReadFile(ctx, "huge", 1<<20)
		if err != nil || len(data) != 1<<20 || size < 1<<20 {
			t.Errorf("capped read: %d of %d, %v", len(data), size, err)
		}
		if _, _, err := box.ReadFile(ctx, "huge", 0); err != nil {
			t.Logf("uncapped read of %d bytes: %v", size, err)
		}
		// A sparse file claims far more than the box could hold.
		sh(t, s, box, "truncate -s 100G /work/sparse")
		data, size, err = box.ReadFile(ctx, "sparse", 0)
		if err == nil && int64(len(data)) == size {
			t.Errorf("read all %d bytes of a sparse file", size)
		}
		if err != nil && errors.Is(err, sandbox.ErrDied) {
			t.Errorf("reading a sparse file killed the box")
		}
		if r := py(t, s, box, "'still here'"); r.value() != "'still here'" {
			t.Errorf("after huge files: %+v", r.ExecResult)
		}
	}},
}

var syscallZero = syscall.Signal(0)

// hostileMarker names every process the battery plants, so the host can be
// searched for survivors.
var hostileMarker = strconv.Itoa(4000000 + os.Getpid()%100000)

func shadowLine(out string) bool {
	for _, p := range []string{"root:$", "root:*:", "root:!", "root:x:0:0:"} {
		if p == "root:x:0:0:" {
			continue // passwd, synthesized; not shadow
		}
		if strings.Contains(out, p) {
			return true
		}
	}
	return false
}

func moduleNames(b []byte) string {
	var names []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			names = append(names, f[0])
		}
	}
	return strings.Join(names, ",")
}

func truncate(b []byte) string {
	if len(b) > 40 {
		return string(b[:40]) + "…"
	}
	return string(b)
}

func runtimeCPUs() int { return max(runtime.NumCPU(), 2) }

// hostVictim starts a host process the box must not be able to touch.
func hostVictim(t *testing.T, s *suite) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("bash", "-c", "exec -a victim-"+hostileMarker+" sleep 600")
	if err := cmd.Start(); err != nil {
		cmd = exec.Command("sleep", "600")
		if err := cmd.Start(); err != nil {
			t.Skipf("cannot start a host victim: %v", err)
		}
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd
}

// countingListener accepts on addr and counts connections; it returns the
// port, or 0 when the address family is unavailable.
func countingListener(t *testing.T, network, addr string, n *atomic.Int64) int {
	l, err := net.Listen(network, addr)
	if err != nil {
		return 0
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			c.Write([]byte("HOST-SECRET\n"))
			c.Close()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

// hostAddrs are the host's own non-loopback IPv4 addresses.
func hostAddrs() []string {
	var out []string
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() {
			out = append(out, ipn.IP.String())
		}
	}
	return out
}

// mustSee fails the case when a process planted with marker is not visible
// on the host: the leftover check after the case would be blind.
func (s *suite) mustSee(t *testing.T, marker string) {
	t.Helper()
	if !s.opts.HostProcesses {
		return
	}
	deadline := time.Now().Add(s.timeout(5 * time.Second))
	for len(leftovers(marker)) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the planted process %s is not visible on the host; the leftover check is blind", marker)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// runHostile runs the battery; after every case it checks that the backend
// still makes a working box and that the case's boxes left nothing behind.
func runHostile(t *testing.T, s *suite) {
	t.Run("hostile", func(t *testing.T) {
		for _, c := range hostile {
			ok := t.Run(c.name, func(t *testing.T) {
				t.Logf("must hold: %s", c.holds)
				c.fn(t, s)
			})
			t.Run(c.name+"/afterwards", func(t *testing.T) {
				s.afterwards(t)
				if !ok {
					t.Logf("the case itself failed")
				}
			})
		}
	})
}

// afterwards checks the host after a case: nothing of its boxes remains and
// the backend still creates a box that answers.
func (s *suite) afterwards(t *testing.T) {
	var left []string
	deadline := time.Now().Add(s.timeout(10 * time.Second))
	for {
		left = nil
		if s.opts.HostProcesses {
			left = append(left, leftovers(hostileMarker)...)
		}
		if lc, ok := s.b.(LeakChecker); ok {
			left = append(left, lc.Leftovers()...)
		}
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, l := range left {
		t.Errorf("outlived its box: %s", l)
	}
	box := s.box(t)
	if r := py(t, s, box, "6 * 7"); r.value() != "42" {
		t.Errorf("a new box does not answer: %+v", r.ExecResult)
	}
	if s.opts.NoShell != "" {
		return
	}
	if r := sh(t, s, box, "echo ok"); r.Stdout.Text != "ok\n" {
		t.Errorf("a new box's shell: %+v", r.ExecResult)
	}
}
