package sandboxtest

import (
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// Per-user kernel counts (inotify instances, user namespaces, POSIX message
// queue bytes, queued signals) are charged up the chain of user namespaces
// to the host uid that owns each level. A box must be charged to an identity
// of its own: while one box holds all it can get, a root process of the
// host and a second box still get theirs.
func init() {
	hostile = append(hostile, hostileCase{
		"accounting: a box exhausts per-user kernel counts",
		"while one box holds every inotify instance, message queue byte and queued signal it can get, a root process on the host and another box still get one of each",
		func(t *testing.T, s *suite) {
			s.needOS(t)
			if os.Getuid() != 0 {
				t.Skip("the host probe must run as root: root's per-user counts are the ones at stake")
			}
			if _, err := exec.LookPath("python3"); err != nil {
				t.Skip("the host probe needs python3 on the host")
			}
			hog, other := s.box(t), s.box(t)
			r := py(t, s, hog, accountingHog)
			if r.Error != nil {
				t.Fatalf("hog: %+v", r.Error)
			}
			t.Logf("the box holds (inotify, why it stopped, mqueues, queued signals, unshare(CLONE_NEWUSER)): %s", r.value())
			out, err := exec.Command("python3", "-c", accountingProbe).CombinedOutput()
			if err != nil {
				t.Fatalf("host probe: %v\n%s", err, out)
			}
			checkProbe(t, "a root process on the host", string(out), false)
			r = py(t, s, other, accountingProbe)
			if r.Error != nil {
				t.Fatalf("probe in the other box: %+v", r.Error)
			}
			checkProbe(t, "another box", r.Stdout.Text, true)
			py(t, s, hog, "_release()")
		},
	})
}

// checkProbe wants every count the probe tried to be available. In a box,
// message queues may be refused outright (Landlock refuses mq_open on the
// jail): then no box can take any either.
func checkProbe(t *testing.T, who, out string, inBox bool) {
	t.Helper()
	var got map[string]string
	if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &got); err != nil {
		t.Fatalf("%s: probe output %q: %v", who, out, err)
	}
	for _, k := range []string{"inotify", "mqueue", "sigqueue"} {
		if inBox && k == "mqueue" && got[k] == "Permission denied" {
			t.Logf("%s: message queues are refused in boxes", who)
			continue
		}
		if got[k] != "ok" {
			t.Errorf("%s cannot get one %s: %s", who, k, got[k])
		}
	}
}

const accountingCommon = `
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
class _MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long), ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
_SIG = signal.SIGRTMIN + 1
def _err():
    return os.strerror(ctypes.get_errno())
def _receiver():
    """A fresh single-threaded python that blocks _SIG: signals queued to
    it stay pending (the kernel has threads that would take them, and
    forking it could deadlock)."""
    import subprocess, sys
    p = subprocess.Popen([sys.executable or "python3", "-c", "import signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, [%d]); print('x', flush=True); sys.stdin.read()" % _SIG], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    p.stdout.readline()
    return p
`

// accountingHog takes, and keeps in the kernel's globals, all it can get.
const accountingHog = accountingCommon + `
import resource
_held = {"ino": [], "mq": []}
# Past the host's per-user limit (128 by default), leaving descriptors
# for what comes next.
while len(_held["ino"]) < min(512, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64):
    fd = libc.inotify_init1(0o2000000)
    if fd < 0:
        break
    _held["ino"].append(fd)
_ino_err = _err()
_attr = _MqAttr(0, 10, 8192, 0)
for i in range(64):  # RLIMIT_MSGQUEUE allows about ten of these
    q = libc.mq_open(b"/kiln-hog-%d" % i, os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(_attr))
    if q < 0:
        break
    _held["mq"].append(q)
_rcv = _receiver()
_queued = 0
while _queued < 1000000 and libc.sigqueue(_rcv.pid, _SIG, ctypes.c_void_p(0)) == 0:
    _queued += 1
_userns = libc.unshare(0x10000000)
def _release():
    for fd in _held["ino"]:
        os.close(fd)
    for i in range(len(_held["mq"])):
        libc.mq_unlink(b"/kiln-hog-%d" % i)
    _rcv.kill()
    _rcv.wait()
(len(_held["ino"]), _ino_err, len(_held["mq"]), _queued, _userns)
`

// accountingProbe tries to get one of each and prints what happened, as
// JSON.
const accountingProbe = accountingCommon + `
import json
res = {}
fd = libc.inotify_init1(0o2000000)
res["inotify"] = "ok" if fd >= 0 else _err()
if fd >= 0:
    os.close(fd)
name = b"/kiln-probe-%d" % os.getpid()
q = libc.mq_open(name, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600, ctypes.byref(_MqAttr(0, 1, 1024, 0)))
res["mqueue"] = "ok" if q >= 0 else _err()
if q >= 0:
    libc.mq_unlink(name)
    os.close(q)
rcv = _receiver()
res["sigqueue"] = "ok" if libc.sigqueue(rcv.pid, _SIG, ctypes.c_void_p(0)) == 0 else _err()
rcv.kill()
rcv.wait()
print(json.dumps(res))
`
