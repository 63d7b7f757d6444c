package gvisor

import (
	"context"
	"strings"
	"testing"
	"time"

	"kiln/internal/sandbox"
)

// agentProbe is model code that looks for kiln-agent's processes in the box
// and tries every way to reach them that gVisor offers: reopening their
// stdio through /proc (the agent's stream to the host), reading their
// memory and environment, stopping them, ptrace and pidfd_getfd. It prints
// its uid, the agents' pids and uids, and what worked.
const agentProbe = `import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
agents = []
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) != os.getpid():
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if b"kiln-agent" in cmd:
            agents.append(int(p))
worked = []
def try_(what, f):
    try:
        r = f()
        if r is None or r >= 0:
            worked.append(what)
    except OSError:
        pass
def opened(path, flags):
    fd = os.open(path, flags)
    os.close(fd)
uids = {}
for p in agents:
    uids[p] = [l.split()[1] for l in open(f"/proc/{p}/status") if l.startswith("Uid:")][0]
    try_(f"list /proc/{p}/fd", lambda: len(os.listdir(f"/proc/{p}/fd")))
    for fd, flags in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
        try_(f"reopen /proc/{p}/fd/{fd}", lambda: opened(f"/proc/{p}/fd/{fd}", flags))
    try_(f"open /proc/{p}/mem", lambda: opened(f"/proc/{p}/mem", os.O_RDONLY))
    try_(f"read /proc/{p}/environ", lambda: len(open(f"/proc/{p}/environ", "rb").read()))
    def stop():
        os.kill(p, signal.SIGSTOP)
        os.kill(p, signal.SIGCONT)
    try_(f"SIGSTOP {p}", stop)
    try_(f"ptrace seize {p}", lambda: libc.ptrace(0x4206, p, 0, 0))
    def getfd():
        pidfd = libc.syscall(434, p, 0)
        if pidfd < 0:
            return -1
        r = libc.syscall(438, pidfd, 1, 0)
        os.close(pidfd)
        return r
    try_(f"pidfd_getfd {p}", getfd)
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith(("CapPrm:", "CapEff:", "CapAmb:"))]
print("uid", os.getuid(), "agents", agents, "uids", uids, "caps", caps)
print("WORKED", worked)`

// TestAgentProtected: code in a gVisor box runs as another user than
// kiln-agent and cannot reach the agent's stream, memory or process.
func TestAgentProtected(t *testing.T) {
	for _, cold := range []bool{true, false} {
		name := map[bool]string{true: "cold", false: "restored"}[cold]
		t.Run(name, func(t *testing.T) {
			b := newTestBackend(t, Options{Cold: cold})
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if !cold {
				if err := b.Warm(ctx, sandbox.Spec{}); err != nil {
					t.Fatalf("Warm: %v", err)
				}
			}
			sb, err := b.Create(ctx, sandbox.Spec{ID: "test-protect-" + name})
			if err != nil {
				t.Fatal(err)
			}
			defer sb.Close()
			out := run(t, sb, agentProbe)
			t.Log(out)
			if !strings.Contains(out, "uid 65534 ") {
				t.Errorf("code does not run as nobody: %s", out)
			}
			if strings.Contains(out, "agents []") {
				t.Fatalf("found no agent process; the probe is blind: %s", out)
			}
			if strings.Contains(out, "'65534'") {
				t.Errorf("an agent runs as the code's user: %s", out)
			}
			if !strings.Contains(out, "caps ['0000000000000000', '0000000000000000', '0000000000000000']") {
				t.Errorf("code has capabilities: %s", out)
			}
			if !strings.Contains(out, "WORKED []") {
				t.Errorf("code reached the agent: %s", out)
			}
			// The agent still works after the probe.
			if got := strings.TrimSpace(run(t, sb, "6 * 7")); got != "42" {
				t.Errorf("after the probe: %q", got)
			}
		})
	}
}

// TestFileToolsAcrossUsers: with the agent and code under different users,
// the file tools still read what code keeps private, write into code's
// directories, and leave what they create to code's user.
func TestFileToolsAcrossUsers(t *testing.T) {
	b := newTestBackend(t, Options{Cold: true})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sb, err := b.Create(ctx, sandbox.Spec{ID: "test-files-users"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if r := shell(t, sb, "umask 077; mkdir -p private/deep && echo secret > private/deep/s && chmod 700 private private/deep && chmod 600 private/deep/s && echo ok"); r.Out != "ok\n" {
		t.Fatalf("preparing: %+v", r)
	}
	if data, _, err := sb.ReadFile(ctx, "private/deep/s", 100); err != nil || string(data) != "secret\n" {
		t.Errorf("ReadFile of code's private file: %q %v", data, err)
	}
	if list, err := sb.ListFiles(ctx, "private"); err != nil || len(list) != 2 {
		t.Errorf("ListFiles of code's private directory: %+v %v", list, err)
	}
	if err := sb.WriteFile(ctx, "private/deep/s", []byte("over\n")); err != nil {
		t.Errorf("WriteFile over code's private file: %v", err)
	}
	if err := sb.WriteFile(ctx, "private/new/dir/f", []byte("from the host\n")); err != nil {
		t.Errorf("WriteFile into code's private directory: %v", err)
	}
	r := shell(t, sb, "cat private/deep/s && echo more >> private/new/dir/f && cat private/new/dir/f && stat -c '%u %n' private/new private/new/dir private/new/dir/f && rm -r private/new && echo removed")
	want := "over\nfrom the host\nmore\n65534 private/new\n65534 private/new/dir\n65534 private/new/dir/f\nremoved\n"
	if r.Out != want {
		t.Errorf("code using what the file tools wrote:\n%s%s\nwant:\n%s", r.Out, r.Err, want)
	}
}

// TestNoJunkInWorkspace: a per-call run that draws a chart leaves nothing
// in the workspace (per-call mode returns every file there): fontconfig's
// and matplotlib's caches and HOME live outside it. A restored box is what
// per-call mode gets by default (-short skips the cold one).
func TestNoJunkInWorkspace(t *testing.T) {
	for _, cold := range []bool{false, true} {
		if cold && testing.Short() {
			continue
		}
		name := map[bool]string{true: "cold", false: "restored"}[cold]
		t.Run(name, func(t *testing.T) {
			b := newTestBackend(t, Options{Cold: cold})
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			spec := sandbox.Spec{ID: "test-junk-" + name, Preload: []string{"numpy", "pandas", "matplotlib"}}
			if !cold {
				if err := b.Warm(ctx, spec); err != nil {
					t.Fatalf("Warm: %v", err)
				}
			}
			sb, err := b.Create(ctx, spec)
			if err != nil {
				t.Fatal(err)
			}
			defer sb.Close()
			out := run(t, sb, `import os, matplotlib.pyplot as plt
plt.plot([1, 2, 3], [1, 4, 9]); plt.title("squares"); plt.xlabel("x")
plt.show()
print(os.environ["HOME"], os.environ.get("XDG_CACHE_HOME"))`)
			t.Logf("HOME, XDG_CACHE_HOME: %s", out)
			if !strings.HasPrefix(out, "/tmp/home /tmp/home/.cache") {
				t.Errorf("HOME and XDG_CACHE_HOME are %q, want the box-private /tmp/home and /tmp/home/.cache every backend has", out)
			}
			files, err := sb.Changes(ctx, time.Unix(0, 0))
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range files {
				t.Errorf("junk in the workspace: %s (%d bytes)", f.Path, f.Size)
			}
		})
	}
}
