# kiln's zygote: the fork server of the jail's template. It runs inside the
# template's namespaces as root of the template's user namespace (with
# capabilities only there), after prepare() imported the preloaded modules,
# and it never runs a cell itself. For every box the host sends one request
# on fd 3 (a SOCK_SEQPACKET socket): a JSON plan and two descriptors, the
# box's end of its agent stream and a pipe for its error messages. The plan
# is data computed by the host from the jail's policy tables (mounts,
# rlimits, Landlock rules, the seccomp program); this file only carries it
# out, in this order:
#
#   template ─fork─▶ G  into a fresh pid namespace, whose PID 1 it is.
#                       The host moves it into the box's cgroup; it
#                       unshares a mount namespace and mounts /work, /tmp,
#                       /dev/shm and /proc while it still holds the
#                       template's capabilities; then it unshares user,
#                       network, ipc, uts and cgroup namespaces, and the
#                       template writes its id maps (one uid range per
#                       box). G sets hostname, loopback and rlimits, drops
#                       every privilege, enters Landlock and seccomp, and
#             ─fork─▶ K  the box's kernel: serve(). G then spawns
#                       kiln-agent, which adopts K over four pipes, and
#                       stays the box's PID 1, reaping.
#
# Library pages stay shared copy-on-write between the template and every
# box. Nothing the template holds is secret, and a box cannot reach it: it
# lives in an ancestor pid namespace, a mount namespace the box only has a
# copy of, and its control socket is closed before anything else happens.
import base64
import ctypes
import fcntl
import gc
import os
import resource
import signal
import socket
import struct

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
O_PATH = 0o10000000
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_RULE_PATH_BENEATH = 1
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

_CTL = None  # the control socket, fd 3
_PIDNS = -1  # our own pid namespace


def _check(ret, what):
    if ret == -1:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))
    return ret


def _b(s):
    return s.encode() if s else None


def _ulong(v):
    return ctypes.c_ulong(v)


def _arrange(fds, keep=0):
    """Make fds[i] descriptor number i (from keep on), close every other."""
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in fds]
    for i, fd in enumerate(moved):
        os.dup2(fd, keep + i)
    os.closerange(keep + len(fds), 1 << 20)


def _unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(m):
    if m.get("if_exists") and not os.path.exists(m["dst"]):
        return
    ret = _libc.mount(_b(m.get("src")), _b(m["dst"]), _b(m.get("type")), _ulong(m.get("flags", 0)), _b(m.get("data")))
    _check(ret, "mounting %s on %s" % (m.get("src") or m.get("type"), m["dst"]))


def _loopback_up():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    finally:
        s.close()


def _prctl(*args):
    return _libc.prctl(*[_ulong(a) for a in args])


def _drop_privileges(plan):
    for cap in range(64):
        if _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == -1 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            _check(-1, "dropping capability %d" % cap)
    _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities")
    gid, uid = plan["gid"], plan["uid"]
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    # Changing to a non-zero uid cleared the effective and permitted sets;
    # clear the inheritable one too. struct __user_cap_header_struct
    # {version, pid}, two struct __user_cap_data_struct of three u32.
    hdr = struct.pack("Ii", 0x20080522, 0)
    data = ctypes.create_string_buffer(24)
    _check(_libc.syscall(ctypes.c_long(plan["sys_capset"]), ctypes.c_char_p(hdr), data), "capset")
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs")


def _landlock(ll):
    if not ll or not ll.get("handled"):
        return
    attr = struct.pack("QQQ", ll["handled"], 0, 0)
    fd = _check(_libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.c_char_p(attr), ctypes.c_size_t(8), ctypes.c_uint(0)), "creating landlock ruleset")
    try:
        for rule in ll["rules"]:
            path, access = rule["path"], rule["access"]
            try:
                pfd = os.open(path, O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                rule = struct.pack("=Qi", access, pfd)  # packed struct landlock_path_beneath_attr
                _check(_libc.syscall(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(fd), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), ctypes.c_char_p(rule), ctypes.c_uint(0)), "adding landlock rule for " + path)
            finally:
                os.close(pfd)
        _check(_libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint(0)), "restricting to landlock ruleset")
    finally:
        os.close(fd)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _seccomp(prog):
    raw = base64.b64decode(prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(raw) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "loading seccomp filter")


def _say(fd, byte):
    """One byte to the host; SO_PASSCRED on its end tells it our pid."""
    os.write(fd, byte)


def _setns(fd, nstype):
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def _box(plan, to_t, from_t):
    """G, PID 1 of a fresh pid namespace, still in the template's others.
    Runs with fds 0/1 = the box's stream, 2 = its error pipe."""
    _say(1, b"c")
    if os.read(0, 1) != b"k":
        raise RuntimeError("the host did not place the box in its cgroup")
    # Mounts first, while we hold the template's capabilities: this mount
    # namespace and our pid namespace belong to its user namespace, so no
    # one in the box's own user namespace can ever change them.
    _unshare(CLONE_NEWNS)
    for m in plan["mounts"]:
        _mount(m)
    _unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP)
    os.write(to_t, b"u")
    if os.read(from_t, 1) != b"m":
        raise RuntimeError("the template did not map the box's ids")
    os.close(to_t)
    os.close(from_t)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    socket.sethostname(plan["hostname"])
    _loopback_up()
    for res, val in plan["rlimits"]:
        resource.setrlimit(res, (val, val))
    os.chdir(plan["workspace"])
    _drop_privileges(plan)
    _landlock(plan.get("landlock"))
    _seccomp(plan["seccomp"])

    req_r, req_w = os.pipe()
    res_r, res_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()  # PID 1 tells the agent how the kernel ended
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    k = os.fork()
    if k == 0:
        # K: the kernel. Only its pipes; never the box's stream.
        os.setpgid(0, 0)
        _arrange([null, out_w, err_w, req_r, res_w])
        return
    # The agent serves as our child (KILN_AGENT_CHILD), spawned without
    # copying our memory; we stay PID 1 and only reap, as its own PID 1
    # mode would, until it exits.
    _arrange([0, 1, 2, req_w, res_r, out_r, err_r, st_r, st_w])
    os.set_inheritable(8, False)  # the write end stays with PID 1
    argv = ["kiln-agent"] + plan["agent_args"] + ["-adopt-kernel", str(k)]
    env = dict(kv.split("=", 1) for kv in plan["env"])
    env["KILN_AGENT_CHILD"] = "1"
    agent = os.posix_spawn(plan["agent"], argv, env)
    os.closerange(0, 8)
    os.closerange(9, 1 << 20)
    # Box processes may signal their PID 1 only where it has a handler;
    # leave them none (Python's own SIGINT one included).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
        if pid == k:
            try:
                os.write(8, b"%d\n" % status)
            except OSError:
                pass
            os.close(8)
        if pid == agent:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _reseed():
    """Forked boxes share the template's random state: draw new seeds."""
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            np_random.seed()
        except Exception:
            pass


def _spawn(plan, fds):
    """Fork G, the box's first process, into a fresh pid namespace, and
    write its id maps once it has its own user namespace. Returns True in
    the box's kernel only, False in the template."""
    a_r = a_w = b_r = b_w = -1
    try:
        # Our children go into a new pid namespace (setns back to our
        # own first: unshare refuses while the last one is pending).
        _setns(_PIDNS, CLONE_NEWPID)
        _unshare(CLONE_NEWPID)
        a_r, a_w = os.pipe()  # G to the template
        b_r, b_w = os.pipe()  # the template to G
        pid = os.fork()
    except OSError as e:
        try:
            os.write(fds[1], ("kiln zygote: forking: %s\n" % e).encode())
        except OSError:
            pass
        pid = -1
    if pid:
        for fd in fds + [a_w, b_r]:
            if fd >= 0:
                os.close(fd)
        if pid > 0:
            _map(pid, plan, a_r, b_w)
        for fd in (a_r, b_w):
            if fd >= 0:
                os.close(fd)
        return False
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _CTL.detach()
        _arrange([fds[0], fds[0], fds[1], a_w, b_r])
        _box(plan, 3, 4)
        _reseed()
        return True
    except BaseException as e:
        try:
            os.write(2, ("kiln zygote: %s: %s\n" % (type(e).__name__, e)).encode())
        except Exception:
            pass
        os._exit(1)


def _map(pid, plan, from_g, to_g):
    """Write the box's uid and gid maps once it has unshared its user
    namespace (the template, in the parent namespace, may; the box may not)."""
    import select

    ready, _, _ = select.select([from_g], [], [], 10)
    if not ready or os.read(from_g, 1) != b"u":
        return  # G died or hung; the host times out and destroys it
    try:
        for name, value in (("setgroups", "deny"), ("gid_map", plan["gid_map"]), ("uid_map", plan["uid_map"])):
            with open("/proc/%d/%s" % (pid, name), "w") as f:
                f.write(value)
        os.write(to_g, b"m")
    except OSError:
        pass


def zygote_main():
    global _CTL, _PIDNS
    preloaded = prepare()
    _CTL = socket.socket(fileno=3)
    _PIDNS = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    # Children of the template are reaped by the kernel; each box's
    # processes are reaped by its own PID 1.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    gc.collect()
    gc.freeze()  # keep the collector off the shared pages in every box
    _CTL.send(json.dumps({"ready": True, "python": sys.version.split()[0], "preloaded": preloaded}).encode())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(_CTL, 1 << 16, 2)
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        try:
            plan = json.loads(msg)
        except ValueError:
            for fd in fds:
                os.close(fd)
            continue
        if _spawn(plan, fds):
            break
    # K, in a new box.
    serve(preloaded)
    os._exit(0)
