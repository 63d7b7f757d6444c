package sandboxtest

import (
	"bytes"
	"fmt"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// The syscall filter's victim tests (internal/boxpolicy/syscalls.go): model
// code calls what the policy refuses through every entry the CPU offers —
// the native `syscall` instruction, the i386 `int 0x80` entry from a
// MAP_32BIT page, and x32-numbered calls (nr | 0x40000000) — and the
// ordinary work of Python, numpy, matplotlib and a shell still runs.

func init() {
	hostile = append(hostile,
		hostileCase{"refused syscalls through every entry: native, i386 int 0x80, x32", "each call ends in EPERM, ENOSYS or SIGSYS, whichever way it enters the kernel", hostileSyscalls},
		hostileCase{"allowed work under the syscall filter", "threads, processes, numpy, pandas, matplotlib, loopback and unix sockets, and the shell's tools work", allowedSyscalls},
	)
}

// probePrelude maps the page below 4 GiB, writes the i386 trampoline
// into it and defines call(entry, nr, args), shared by the probe and by
// the host control.
const probePrelude = `
import ctypes, errno, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.syscall.restype = ctypes.c_long
MAP_32BIT = 0x40
page = libc.mmap(None, 3 * 4096, 7, 0x22 | MAP_32BIT, -1, 0)
if page in (None, ctypes.c_void_p(-1).value) or page >= 1 << 32:
    print("all all skip:no MAP_32BIT page"); sys.exit(0)
# long tramp(nr, a1..a5): the i386 entry from 64-bit code.
code = bytes.fromhex("53" "55" "4889f8" "4889f3" "4989ca" "4889d1" "4c89d2" "4c89c6" "4c89cf" "cd80" "4863c0" "5d" "5b" "c3")
ctypes.memmove(page, code, len(code))
L = ctypes.c_long
tramp = ctypes.CFUNCTYPE(L, L, L, L, L, L, L)(page)
data = page + 4096

def put(off, b):
    ctypes.memmove(data + off, b, len(b))
    return data + off

def call(entry, nr, args):
    args = [L(a) for a in args] + [L(0)] * (5 - len(args))
    if entry == "i386":
        r = tramp(L(nr), *args)
        return r if r >= 0 or r < -4095 else -1, (-r if -4096 < r < 0 else 0)
    if entry == "x32":
        nr |= 0x40000000
    ctypes.set_errno(0)
    r = libc.syscall(L(nr), *args)
    return r, ctypes.get_errno()

def outcome(pid):
    """What became of the child pid: ok, an errno name, or killed:N."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed:%d" % os.WTERMSIG(status)
    c = os.WEXITSTATUS(status)
    return "ok" if c == 0 else errno.errorcode.get(c, "errno%d" % c)

`

// hostControl runs getpid through each entry in a plain process on the
// host, outside any box and filter: an entry the host's kernel lacks (no
// IA32 emulation: int 0x80 faults; no x32 ABI: ENOSYS) cannot be attacked
// in a box that runs on it, and what a box answers there says nothing of
// its policy.
const hostControl = probePrelude + `
for entry, nr in (("native", 39), ("i386", 20), ("x32", 39)):
    pid = os.fork()
    if pid == 0:
        r, e = call(entry, nr, ())
        os._exit(0 if r == os.getpid() else min(e, 255) or 254)
    print(entry, outcome(pid), flush=True)
`

// syscallProbe runs each call in a forked, single-threaded child (so
// unshare can work, and a kill takes only that child) and prints one line
// per call and entry: "entry name outcome", outcome being "ok" (the call
// succeeded), an errno name, "killed:N" or "skip:why". The numbers are
// x86_64's (native, and x32 with the x32 bit) and i386's. Every argument a
// call points at lives in a page below 4 GiB, so all entries see the same
// call, and each call would succeed in an unfiltered, unprivileged process
// where the host allows it.
const syscallProbe = probePrelude + `
pidfd = libc.syscall(L(434), L(os.getpid()), L(0))
put(0, bytes(512))                                  # io_uring_params, zeroed
put(512, struct.pack("IIQQQQQ", 1, 128, 1, 0, 0, 0, 1 | 1 << 5 | 1 << 6) + bytes(80))  # perf: sw task-clock, self, user only
put(768, struct.pack("IIII", 2, 4, 4, 1) + bytes(56))  # bpf: a one-entry array map
user, desc, payload = put(1024, b"user\0"), put(1040, b"kiln\0"), put(1056, b"x\0")
none, tmp, tmpfs = put(1072, b"none\0"), put(1088, b"/tmp\0"), put(1104, b"tmpfs\0")
put(1120, struct.pack("III", 40, 1, 0))              # socketcall args: AF_VSOCK stream
sc = data + 1120

NEWUSER, NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
# name: (x86_64 nr, i386 nr, x32 nr, args)
calls = {
    "unshare(NEWUSER|NEWNET)": (272, 310, 272, (NEWUSER | NEWNET,)),
    "clone(NEWUSER)": (56, 120, 56, (NEWUSER | SIGCHLD, 0, 0, 0, 0)),
    "socket(AF_PACKET)": (41, 359, 41, (17, 3, 0x0300)),
    "socket(AF_VSOCK)": (41, 359, 41, (40, 1, 0)),
    "socket(AF_NETLINK, SOCK_DIAG)": (41, 359, 41, (16, 3, 4)),
    "socket(AF_NETLINK, KOBJECT_UEVENT)": (41, 359, 41, (16, 2, 15)),
    "socket(AF_ALG)": (41, 359, 41, (38, 5, 0)),
    "socket(AF_BLUETOOTH)": (41, 359, 41, (31, 3, 0)),
    "socket(AF_INET, SOCK_RAW)": (41, 359, 41, (2, 3, 1)),
    "socketcall(AF_VSOCK)": (None, 102, None, (1, sc)),
    "socketpair(AF_INET)": (53, 360, 53, (2, 1, 0, data + 1200)),
    "io_uring_setup": (425, 425, 425, (1, data)),
    "userfaultfd": (323, 374, 323, (1 | 0o2000000,)),
    "perf_event_open": (298, 336, 298, (data + 512, 0, -1, -1, 0)),
    "bpf(MAP_CREATE)": (321, 357, 321, (0, data + 768, 72)),
    "keyctl(GET_KEYRING_ID)": (250, 288, 250, (0, -2, 1)),
    "add_key": (248, 286, 248, (user, desc, payload, 1, -2)),
    "ptrace(TRACEME)": (101, 26, 521, (0, 0, 0, 0)),
    "kcmp(self)": (312, 349, 312, (os.getpid(), os.getpid(), 1, 0, 0)),
    "pidfd_getfd(self)": (438, 438, 438, (pidfd, 0, 0)),
    "mount(tmpfs)": (165, 21, 165, (none, tmp, tmpfs, 0, 0)),
    "fsopen(tmpfs)": (430, 430, 430, (tmpfs, 0)),
    "personality(ADDR_NO_RANDOMIZE)": (135, 136, 135, (0x0040000,)),
    "prctl(CAP_AMBIENT_CLEAR_ALL)": (157, 172, 157, (47, 4, 0, 0, 0)),
}

sys.stdout.flush()
for name, (native, i386, x32, args) in calls.items():
    for entry, nr in (("native", native), ("i386", i386), ("x32", x32)):
        if nr is None:
            continue
        if name == "pidfd_getfd(self)" and pidfd < 0:
            print(entry, name, "skip:no pidfd"); continue
        pid = os.fork()
        if pid == 0:
            r, e = call(entry, nr, args)
            if r == 0 and name.startswith("clone"):
                os._exit(0)  # the new process
            os._exit(0 if r >= 0 else min(e, 255) or 254)
        print(entry, name, outcome(pid), flush=True)
`

// hostEntries runs hostControl on the host once per test binary: entry
// -> "" where the host's kernel serves it, else why the variant skips.
var hostEntries = sync.OnceValue(func() map[string]string {
	why := map[string]string{}
	out, err := exec.Command("python3", "-c", hostControl).CombinedOutput()
	if err != nil {
		for _, e := range []string{"i386", "x32"} {
			why[e] = fmt.Sprintf("the host control (getpid through each entry, outside any box) could not run: %v: %s", err, bytes.TrimSpace(out))
		}
		return why
	}
	seen := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if f := strings.Fields(line); len(f) >= 2 {
			seen[f[0]] = f[len(f)-1]
		}
	}
	for _, e := range []string{"native", "i386", "x32"} {
		switch got := seen[e]; got {
		case "ok":
			why[e] = ""
		case "":
			why[e] = fmt.Sprintf("the host control printed nothing for the %s entry: %q", e, out)
		default:
			why[e] = fmt.Sprintf("the host's kernel does not serve the %s entry: getpid through it, in a plain process outside any box, ended in %s", e, got)
		}
	}
	return why
})

// hostileSyscalls runs syscallProbe in a box. Under kiln's syscall
// policy (jail, gVisor) each call must end in EPERM (an explicit refusal),
// ENOSYS (unknown to the policy, or the entry is) or a kill by SIGSYS; any
// other errno means the call reached a kernel. A capability check of the
// kernel behind an allowed call would also say EPERM, which is why the
// calls are chosen to succeed without one where nothing filters them
// (mount, fsopen, bpf and raw sockets are the exceptions, and are there
// for their other entries). Backends with a kernel of their own
// (Options.OwnKernel) are held only to refusing namespaces.
//
// Each entry is a subtest. On a backend whose boxes run on the host's
// kernel, an entry that kernel lacks (hostEntries) skips: a box's answer
// through it is the host's fault, neither a refusal by the policy nor a
// breach.
func hostileSyscalls(t *testing.T, s *suite) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the probe's syscall numbers and its i386 trampoline are x86_64's")
	}
	r := sh(t, s, s.box(t), "python3 - <<'EOF'\n"+syscallProbe+"EOF")
	lines := strings.Split(strings.TrimSpace(r.Stdout.Text), "\n")
	if len(lines) < 60 {
		t.Fatalf("the probe did not run:\n%s", r.out)
	}
	byEntry := map[string][][]string{}
	for _, line := range lines {
		f := strings.Fields(line)
		if len(f) < 3 {
			t.Errorf("probe line %q", line)
			continue
		}
		byEntry[f[0]] = append(byEntry[f[0]], f)
	}
	refused := map[string]bool{"EPERM": true, "ENOSYS": true, "killed:31": true}
	for _, entry := range []string{"native", "i386", "x32"} {
		t.Run(entry, func(t *testing.T) {
			if len(byEntry[entry]) == 0 {
				t.Fatalf("the probe printed nothing for the %s entry:\n%s", entry, r.out)
			}
			if !s.opts.OwnKernel {
				if why := hostEntries()[entry]; why != "" {
					t.Skipf("%s; the box runs on that kernel, so this variant cannot tell the policy's refusal from the host's", why)
				}
			}
			for _, f := range byEntry[entry] {
				name, out := strings.Join(f[1:len(f)-1], " "), f[len(f)-1]
				switch {
				case s.opts.OwnKernel:
					// The guest kernel is the box's own: only namespaces,
					// which the guest forbids, must be refused.
					if out == "ok" && strings.Contains(name, "NEWUSER") {
						t.Errorf("%s %s succeeded in the box", entry, name)
					}
					t.Logf("%s %s: %s (the box's own kernel)", entry, name, out)
				case strings.HasPrefix(out, "skip:"):
					t.Logf("%s %s: %s", entry, name, out)
				case out == "ok":
					t.Errorf("%s %s succeeded in the box", entry, name)
				case !refused[out]:
					t.Errorf("%s %s reached the kernel (%s): not refused by the box's syscall policy", entry, name, out)
				default:
					t.Logf("%s %s: %s", entry, name, out)
				}
			}
		})
	}
}

// allowedSyscalls is the other side of an allowlist: what model code
// ordinarily does still works.
func allowedSyscalls(t *testing.T, s *suite) {
	s.needOS(t)
	box := s.box(t)
	r := py(t, s, box, `import asyncio, mmap, multiprocessing, os, select, signal, socket, subprocess, sys, tempfile, threading, time
out = []
def check(name, f):
    try:
        f()
    except Exception as e:
        out.append("%s: %r" % (name, e))

def threads():
    seen = []
    ts = [threading.Thread(target=seen.append, args=(i,)) for i in range(8)]
    [t.start() for t in ts]; [t.join() for t in ts]
    assert sorted(seen) == list(range(8))
check("threads", threads)
check("subprocess", lambda: subprocess.run(["sh", "-c", "echo hi | cat"], check=True, capture_output=True).stdout == b"hi\n" or 1/0)
check("posix_spawn", lambda: os.waitpid(os.posix_spawn("/bin/true", ["true"], {}), 0))
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
check("fork", fork)
def pool():
    with multiprocessing.get_context("fork").Pool(2) as p:
        assert p.map(abs, [-1, -2, -3]) == [1, 2, 3]
check("multiprocessing", pool)
def numpy_pandas():
    import numpy as np, pandas as pd
    a = np.random.default_rng(1).random((300, 300))
    assert np.allclose(a @ np.linalg.inv(a) @ a, a)
    assert pd.DataFrame({"x": [1, 2, 3]}).describe().loc["mean", "x"] == 2
check("numpy/pandas", numpy_pandas)
def plot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(); ax.plot([1, 2, 3]); ax.set_title("t")
    fig.savefig("/work/allowed.png"); plt.close(fig)
    assert os.path.getsize("/work/allowed.png") > 1000
check("matplotlib", plot)
def tcp(fam, host):
    srv = socket.socket(fam); srv.bind((host, 0)); srv.listen()
    c = socket.create_connection(srv.getsockname()[:2]); a, _ = srv.accept()
    c.sendall(b"ping"); assert a.recv(4) == b"ping"
    for x in (a, c, srv): x.close()
check("tcp loopback", lambda: tcp(socket.AF_INET, "127.0.0.1"))
if socket.has_ipv6 and os.path.exists("/proc/net/if_inet6") and open("/proc/net/if_inet6").read():
    check("tcp6 loopback", lambda: tcp(socket.AF_INET6, "::1"))
def udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0))
    v = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); v.sendto(b"x", u.getsockname())
    assert u.recv(1) == b"x"
check("udp loopback", udp)
def unix():
    a, b = socket.socketpair(); a.send(b"u"); assert b.recv(1) == b"u"
    p = tempfile.mktemp(dir="/tmp"); srv = socket.socket(socket.AF_UNIX); srv.bind(p); srv.listen()
    c = socket.socket(socket.AF_UNIX); c.connect(p); srv.accept()[0].send(b"v"); assert c.recv(1) == b"v"
check("unix sockets", unix)
check("netlink route", lambda: socket.if_nameindex())
check("getaddrinfo", lambda: socket.getaddrinfo("localhost", 80))
async def aio():
    await asyncio.sleep(0.01)
    p = await asyncio.create_subprocess_exec("true"); await p.wait()
check("asyncio", lambda: asyncio.run(aio()))
def misc():
    m = mmap.mmap(-1, 1 << 20); m[:3] = b"abc"; m.close()
    signal.setitimer(signal.ITIMER_REAL, 0.01); time.sleep(0.05)
    r, w = os.pipe(); os.write(w, b"x"); select.select([r], [], [], 1); select.poll().register(r)
    os.sched_getaffinity(0); os.getrandom(8); os.cpu_count(); os.uname()
    os.mkfifo("/tmp/fifo"); os.symlink("/tmp/fifo", "/tmp/link"); os.utime("/tmp/link", follow_symlinks=False)
    fd = os.memfd_create("m"); os.truncate(fd, 10); os.close(fd)
    open("/tmp/src", "wb").write(b"s" * 100000)
    import shutil; shutil.copyfile("/tmp/src", "/tmp/dst"); assert os.path.getsize("/tmp/dst") == 100000
check("misc", lambda: (signal.signal(signal.SIGALRM, lambda *a: None), misc()))
out`)
	if r.Error != nil || r.value() != "[]" {
		t.Errorf("allowed work failed in the box: %s %+v", r.value(), r.Error)
	}
	rs := sh(t, s, box, `set -e
cd /tmp; mkdir -p d; echo hello > d/a; cp d/a d/b; cp -r d e; mv e/b e/c; ln -s a d/l; ls -la d e >/dev/null
sort d/a | uniq | wc -l >/dev/null; tar -cf t.tar d; tar -tf t.tar >/dev/null; find . -name a >/dev/null
timeout 5 sleep 0.1; date >/dev/null; id >/dev/null; ps ax >/dev/null 2>&1 || true; stat d/a >/dev/null
(sleep 0.1 &) ; wait; echo $(( 6 * 7 )) | tee f >/dev/null; cat f; head -c 1000 /dev/urandom | od | tail -1 >/dev/null
python3 -c 'import numpy; print("py ok")'`)
	if rs.ExitCode != 0 || !strings.Contains(rs.Stdout.Text, "42\npy ok") {
		t.Errorf("the shell's tools failed in the box: %+v", rs.ExecResult)
	}
}
