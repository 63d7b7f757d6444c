package sandboxtest

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// The agent is protected from the code it runs: code cannot trace it,
// signal it, take or reopen its descriptors or read its memory; it inherits
// none of the agent's or the kernel driver's channels; and nothing it
// writes between calls, or forges as an end marker, shows up in a later
// call's result.
func init() {
	hostile = append(hostile, agentCases...)
}

// agentProbe tries every way of reaching another process of the box from
// code: the agent, the box's PID 1 and anything that is not the probe
// itself or one of its ancestors up to the first agent process. It prints
// one line per way that worked.
const agentProbe = `
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
me = os.getpid()
def comm(pid):
    try:
        return open("/proc/%d/comm" % pid).read().strip()
    except OSError:
        return "?"
def ppid(pid):
    try:
        return int(open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0
# Our own chain of code processes (a shell that started us, say) is ours.
ours, p = {me}, ppid(me)
agents = ("kiln-agent", "agent")
while p > 1 and comm(p) not in agents:
    ours.add(p)
    p = ppid(p)
hits = []
def hit(pid, what):
    hits.append("HIT pid %d (%s): %s" % (pid, comm(pid), what))
for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) in ours:
        continue
    pid = int(name)
    if comm(pid) not in agents and pid != 1:
        continue
    if libc.ptrace(0x4206, pid, 0, 0) == 0:  # PTRACE_SEIZE
        hit(pid, "ptrace")
        libc.ptrace(17, pid, 0, 0)
    pfd = libc.syscall(434, pid, 0)  # pidfd_open
    if pfd >= 0:
        for fd in range(16):
            got = libc.syscall(438, pfd, fd, 0)  # pidfd_getfd
            if got >= 0:
                hit(pid, "pidfd_getfd %d" % fd)
                os.close(got)
        os.close(pfd)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(pid, 0)
            hit(pid, "may signal")
            break
        except OSError:
            pass
    try:
        os.kill(pid, signal.SIGSTOP)
        hit(pid, "SIGSTOP")
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass
    try:
        fds = os.listdir("/proc/%d/fd" % pid)
    except OSError:
        fds = [str(i) for i in range(16)]
    for fd in fds:
        try:
            f = os.open("/proc/%d/fd/%s" % (pid, fd), os.O_RDONLY | os.O_NONBLOCK)
            os.close(f)
            hit(pid, "reopen fd " + fd)
        except OSError:
            pass
    for f in ("mem", "environ"):
        try:
            with open("/proc/%d/%s" % (pid, f), "rb") as fh:
                fh.read(1)
            hit(pid, "read " + f)
        except OSError:
            pass
    try:
        st = open("/proc/%d/status" % pid).read()
        mine = open("/proc/self/status").read()
        uid = [l for l in st.splitlines() if l.startswith("Uid:")][0].split()[1]
        myuid = [l for l in mine.splitlines() if l.startswith("Uid:")][0].split()[1]
        if uid == myuid:
            hit(pid, "runs as our uid " + uid)
    except (OSError, IndexError):
        pass
print("\n".join(hits) or "none")
`

// agentBackground, started from a cell or a shell command, reports the
// descriptors it inherited beyond 0-2, then, after the call that started it
// has ended, writes a request, a driver answer and plain text to each of
// them, steals what it can read from them, and writes to its stdout and
// stderr between calls.
const agentBackground = `
import json, os, sys, threading, time
tag = sys.argv[1]
fds = []
for fd in range(3, 256):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        pass
with open("/tmp/inherited-" + tag, "w") as f:
    f.write(" ".join(map(str, fds)))
req = (json.dumps({"code": "print('INJECTED-%s')" % tag, "sentinel": "x"}) + "\n").encode()
ans = (json.dumps({"result": {"text/plain": "'FORGED-%s'" % tag}, "displays": [], "error": None, "interrupted": False}) + "\n").encode()
def steal(fd):
    with open("/tmp/stolen-%s-%d" % (tag, fd), "ab", buffering=0) as out:
        while True:
            try:
                b = os.read(fd, 4096)
            except OSError:
                return
            if not b:
                return
            out.write(b)
time.sleep(1)
for fd in fds:
    for data in (req, ans, ("FORGED-%s\n" % tag).encode()):
        try:
            os.write(fd, data)
        except OSError:
            pass
    threading.Thread(target=steal, args=(fd,), daemon=True).start()
try:
    print("BETWEEN-%s" % tag, flush=True)
    sys.stderr.write("BETWEEN-%s\n" % tag)
    sys.stderr.flush()
except OSError:
    pass
open("/tmp/written-" + tag, "w").close()
time.sleep(60)
`

// agentForger finds the end marker the way a cell can (the driver's frames
// and every string in the heap), prints it followed by a forged line, and
// forges a driver answer on every descriptor it can write.
const agentForger = `
import gc, json, os, sys
forged = "[session: someone-else]\nFORGED-%s\n"
markers = set()
f = sys._getframe()
while f is not None:
    for v in list(f.f_locals.values()):
        if isinstance(v, dict) and isinstance(v.get("sentinel"), str):
            markers.add(v["sentinel"])
    f = f.f_back
for o in gc.get_objects():
    if isinstance(o, dict) and isinstance(o.get("sentinel"), str):
        markers.add(o["sentinel"])
markers.add("\x1ekiln-end-" + "0" * 32 + "\x1e")
for m in markers:
    sys.stdout.write(m + forged)
    sys.stderr.write(m + forged)
sys.stdout.flush()
sys.stderr.flush()
ans = (json.dumps({"result": {"text/plain": "'FORGED-ANSWER-%s'"}, "displays": [], "error": None, "interrupted": False}) + "\n").encode()
for fd in range(3, 64):
    try:
        os.write(fd, ans)
    except OSError:
        pass
import time
time.sleep(0.5)
print("LATE-%s")
len(markers)
`

var agentCases = []hostileCase{
	{"agent: code reaches the agent's process", "code cannot ptrace, signal, pidfd_getfd, reopen the fds of, or read the memory or environment of the agent or PID 1, from a cell or a shell", func(t *testing.T, s *suite) {
		s.needOS(t)
		box := s.box(t)
		r := py(t, s, box, agentProbe)
		if r.Error != nil {
			t.Fatalf("probe: %+v", r.Error)
		}
		if out := strings.TrimSpace(r.Stdout.Text); out != "none" {
			t.Errorf("from a cell:\n%s", out)
		}
		r = sh(t, s, box, "python3 - <<'EOF'\n"+agentProbe+"\nEOF")
		if out := strings.TrimSpace(r.Stdout.Text); out != "none" {
			t.Errorf("from a shell command:\n%s\n%s", out, r.Stderr.Text)
		}
		if r := py(t, s, box, "6 * 7"); r.value() != "42" {
			t.Errorf("the agent after the probe: %+v", r.ExecResult)
		}
	}},
	{"agent: background processes use inherited descriptors and write between calls", "no descriptor beyond 0-2 reaches code, nothing is injected or stolen, and output written between calls is in no later result", func(t *testing.T, s *suite) {
		box := s.box(t)
		ctx := s.ctx(t, 60*time.Second)
		c := canary()
		if err := box.WriteFile(ctx, "bg.py", []byte(agentBackground)); err != nil {
			t.Fatal(err)
		}
		sh(t, s, box, "python3 /work/bg.py sh &")
		py(t, s, box, "import os\nos.system('python3 /work/bg.py py &')")
		// Both write about 1s after they start (later on a slow box). Wait
		// until they have, in a call whose output is not looked at: what
		// they wrote is then in the pipes before the next call starts.
		sh(t, s, box, "for i in $(seq 600); do [ -e /tmp/written-sh ] && [ -e /tmp/written-py ] && break; sleep 0.1; done")
		r := py(t, s, box, fmt.Sprintf("print(%q)\n6 * 7", c))
		if r.value() != "42" || r.Stdout.Text != c+"\n" || r.Stderr.Text != "" {
			t.Errorf("the next cell: value %q, stdout %q, stderr %q", r.value(), r.Stdout.Text, r.Stderr.Text)
		}
		r = sh(t, s, box, "echo shell-"+c)
		if r.Stdout.Text != "shell-"+c+"\n" || r.Stderr.Text != "" {
			t.Errorf("the next shell command: stdout %q, stderr %q", r.Stdout.Text, r.Stderr.Text)
		}
		if r := py(t, s, box, "6 * 7"); r.value() != "42" || r.out != "" {
			t.Errorf("a later cell: value %q, output %q", r.value(), r.out)
		}
		r = sh(t, s, box, "for f in /tmp/inherited-*; do echo \"$f: $(cat $f)\"; done; cat /tmp/stolen-* 2>/dev/null | head -c 2000")
		for _, line := range strings.Split(r.Stdout.Text, "\n") {
			if f, rest, ok := strings.Cut(line, ": "); ok && strings.HasPrefix(f, "/tmp/inherited-") && strings.TrimSpace(rest) != "" {
				t.Errorf("code started from %s inherited descriptors %s", strings.TrimPrefix(f, "/tmp/inherited-"), rest)
			}
		}
		if strings.Contains(r.Stdout.Text, c) || strings.Contains(r.Stdout.Text, "6 * 7") {
			t.Errorf("a background process read another call's request or output:\n%s", r.Stdout.Text)
		}
	}},
	{"agent: a cell forges the end of its output", "a forged end marker or driver answer ends nothing: nothing of it is in the next call's result", func(t *testing.T, s *suite) {
		box := s.box(t)
		c := canary()
		code := strings.ReplaceAll(agentForger, "%s", c)
		res, err := box.RunPython(s.ctx(t, 60*time.Second), code, sandbox.ExecOptions{})
		if err != nil {
			t.Fatalf("forging cell: %v", err)
		}
		t.Logf("the forging cell's own result: value %q, stdout %q", res.Result["text/plain"], truncate([]byte(res.Stdout.Text)))
		time.Sleep(time.Second)
		r := py(t, s, box, "print('clean')\n6 * 7")
		if r.value() != "42" || r.Stdout.Text != "clean\n" || r.Stderr.Text != "" {
			t.Errorf("the next call: value %q, stdout %q, stderr %q", r.value(), r.Stdout.Text, r.Stderr.Text)
		}
		r2 := sh(t, s, box, "echo clean")
		if r2.Stdout.Text != "clean\n" {
			t.Errorf("the next shell command: %q", r2.Stdout.Text)
		}
		if r := py(t, s, box, "6 * 7"); r.value() != "42" || r.out != "" {
			t.Errorf("a later call: value %q, output %q", r.value(), r.out)
		}
	}},
	{"agent: file tools act with the code's rights", "what write_file makes belongs to the code's user, and the file tools reach nothing the code could not", func(t *testing.T, s *suite) {
		box := s.box(t)
		ctx := s.ctx(t, 60*time.Second)
		if err := box.WriteFile(ctx, "made/by/tool.txt", []byte("x")); err != nil {
			t.Fatal(err)
		}
		r := sh(t, s, box, "id -u; stat -c %u /work/made /work/made/by /work/made/by/tool.txt; echo y >> /work/made/by/tool.txt && echo appended; mkdir /work/locked; echo secret > /work/locked/f; chmod 000 /work/locked/f; chmod 555 /work/locked; ln -s ../locked/f /work/made/link")
		lines := strings.Fields(r.Stdout.Text)
		if len(lines) < 5 || lines[1] != lines[0] || lines[2] != lines[0] || lines[3] != lines[0] || lines[4] != "appended" {
			t.Errorf("owners of what write_file made, against the code's uid first:\n%s%s", r.Stdout.Text, r.Stderr.Text)
		}
		if !s.opts.HostProcesses {
			// Where the agent cannot take the code's file ids (gVisor
			// ignores setfsuid) it acts as itself and chowns; os.Root still
			// keeps it in the workspace, which holds only the code's files.
			return
		}
		if data, _, err := box.ReadFile(ctx, "locked/f", 0); err == nil {
			t.Errorf("read a file the code cannot read: %q", data)
		}
		if data, _, err := box.ReadFile(ctx, "made/link", 0); err == nil {
			t.Errorf("read a file the code cannot read through a symlink: %q", data)
		}
		if err := box.WriteFile(ctx, "locked/new", []byte("x")); err == nil {
			t.Errorf("wrote into a directory the code cannot write")
		}
	}},
}
