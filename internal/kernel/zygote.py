# kiln's zygote: the fork server of the jail's template. It runs in the
# template's mount, pid, network, ipc and uts namespaces but in the host's
# user namespace, as the unprivileged host uid the template runs as, with
# only CAP_SETUID, CAP_SETGID and CAP_SETFCAP, after prepare() imported the
# preloaded modules, and it never runs a cell itself. For every box the
# host sends one request on fd 3 (a SOCK_SEQPACKET socket): a JSON plan and
# two descriptors, the box's end of its agent stream and a pipe for its
# error messages. The plan is data the host generates from the box plan
# that a directly started box's init interprets too (package boxpolicy:
# mounts, rlimits, Landlock rules, environment; and the seccomp program);
# this file only carries it out, in this order (the two-step form; see
# _clone_box for the one-step form the template uses when it can):
#
#   template ─fork─▶ G  says 'c'; the host moves it into the box's cgroup.
#                       G becomes the box's own host uid and creates the
#                       box's user, mount, pid, network, ipc, uts and cgroup
#                       namespaces: the user namespace is a child of the
#                       host's, owned by that uid, so the kernel charges
#                       the box's per-user counts there. The template,
#                       privileged in the host's namespace, writes its id
#                       maps (the box's root is its owner).
#             ─fork─▶ P  PID 1 of the box's pid namespace; G exits. P says
#                       'p', mounts /work, /tmp, /dev/shm and /proc, sets
#                       hostname, loopback and rlimits, and
#                       keeps only the agent's capabilities, enters
#                       Landlock and seccomp, and
#             ─fork─▶ K  the box's kernel: drops every privilege, becomes
#                       the code's uid and serves. P executes kiln-agent,
#                       which adopts K over its pipes and stays the box's
#                       PID 1, serving and reaping. The agent runs as the
#                       box's root and makes itself non-dumpable, K and
#                       everything it starts as the code's uid: code cannot
#                       signal, trace or read the agent.
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
SIGCHLD = 17

PR_SET_DUMPABLE = 4
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
_SYS_CAPSET = -1  # capset(2)'s number, from the plan
_SYS_CAPGET = -1  # capget(2)'s
_SYS_CLONE = -1  # clone(2)'s, from the plan; absent: the two-step fork
# Calls that must keep the GIL, as os.fork does around fork(2).
_libc_gil = ctypes.PyDLL(None, use_errno=True)


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


def _capset(keep, inheritable=0):
    """Set this thread's permitted and effective sets to keep. struct
    __user_cap_header_struct {version, pid}, two struct
    __user_cap_data_struct {effective, permitted, inheritable} of u32."""
    hdr = struct.pack("Ii", 0x20080522, 0)
    lo, hi = keep & 0xFFFFFFFF, keep >> 32
    data = ctypes.create_string_buffer(struct.pack("6I", lo, lo, inheritable & 0xFFFFFFFF, hi, hi, inheritable >> 32), 24)
    return _libc.syscall(ctypes.c_long(_SYS_CAPSET), ctypes.c_char_p(hdr), data)


def _permitted():
    """This thread's permitted set."""
    hdr = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0), 8)
    data = ctypes.create_string_buffer(24)
    _check(_libc.syscall(ctypes.c_long(_SYS_CAPGET), hdr, data), "capget")
    _, prm_lo, _, _, prm_hi, _ = struct.unpack("6I", data.raw)
    return prm_lo | prm_hi << 32


def _bounding(keep):
    for cap in range(64):
        if keep & (1 << cap):
            continue
        if _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == -1 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            _check(-1, "dropping capability %d" % cap)
    _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities")


def _drop_privileges(plan):
    """K: no capability at all, as the code's uid. P emptied the bounding
    and ambient sets already; K runs under P's seccomp filter, which lets
    it change ids and capability sets but not drop bounding ones."""
    gid, uid = plan["gid"], plan["uid"]
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    # Changing to a non-zero uid cleared the effective and permitted sets;
    # clear the inheritable one too.
    _check(_capset(0), "capset")


def _agent_privileges(plan):
    """P and the agent: root of the box's user namespace with only the
    capabilities the agent needs to run code as another uid and signal it:
    permitted, effective and inheritable, which a root exec keeps; the
    bounding set empty, so nothing exec'd gains more."""
    keep = plan["agent_caps"]
    # The inheritable set may only grow within the bounding set: set it
    # while that is whole (we hold every capability of the box here).
    _check(_capset(_permitted(), keep), "capset")
    _bounding(0)
    _check(_capset(keep, keep), "capset")
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


def _box(plan, to_t, from_t):
    """G, in the template's namespaces. Runs with fds 0/1 = the box's
    stream, 2 = its error pipe. Returns only in K."""
    _say(1, b"c")
    if os.read(0, 1) != b"k":
        raise RuntimeError("the host did not place the box in its cgroup")
    host = plan["host_id"]
    os.setresgid(host, host, host)
    os.setresuid(host, host, host)
    # The uid change made us non-dumpable, which would give our /proc
    # files to root: the template could not write our id maps.
    _check(_prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "setting dumpable")
    _unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP)
    os.write(to_t, b"u")
    if os.read(from_t, 1) != b"m":
        raise RuntimeError("the template did not map the box's ids")
    os.close(to_t)
    os.close(from_t)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    if os.fork():
        os._exit(0)
    _pid1(plan)


def _box_cloned(plan, to_t, from_t):
    """P, cloned by the template straight into the box's user and pid
    namespaces (_clone_box), as PID 1. Runs with fds 0/1 = the box's
    stream, 2 = its error pipe. Returns only in K."""
    # Born with the template's uids, changed for the clone: non-dumpable,
    # which would give our /proc files to root and the template could not
    # write our id maps.
    _check(_prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "setting dumpable")
    os.write(to_t, b"u")
    _say(1, b"c")
    if os.read(0, 1) != b"k":
        raise RuntimeError("the host did not place the box in its cgroup")
    if os.read(from_t, 1) != b"m":
        raise RuntimeError("the template did not map the box's ids")
    os.close(to_t)
    os.close(from_t)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    # The rest of the box's namespaces, now that we are in its cgroup: the
    # cgroup namespace's root is the box's group, and what the kernel
    # allocates for them is charged to the box.
    _unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP)
    _pid1(plan)


def _pid1(plan):
    """P, PID 1 of the box's pid namespace, root of its user namespace, in
    all its namespaces and its cgroup. Returns only in K."""
    _check(_prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "setting non-dumpable")
    _say(1, b"p")
    for m in plan["mounts"]:
        _mount(m)
    socket.sethostname(plan["hostname"])
    _loopback_up()
    for res, val in plan["rlimits"]:
        resource.setrlimit(res, (val, val))
    os.chdir(plan["workspace"])

    # Landlock and seccomp once, here: K inherits them, so it copies (and
    # dirties) no more of the template's pages than it must.
    _agent_privileges(plan)
    _landlock(plan.get("landlock"))
    _seccomp(plan["seccomp"])
    req_r, req_w = os.pipe()
    res_r, res_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    k = os.fork()
    if k == 0:
        # K: the kernel. Only its pipes; never the box's stream.
        os.setpgid(0, 0)
        _drop_privileges(plan)
        _arrange([null, out_w, err_w, req_r, res_w])
        return
    # Now become the agent, which adopts K over its pipes on fds 3-8
    # (agent.AdoptedFiles), write ends of stdout and stderr included, and
    # stays PID 1, serving and reaping: our copy of the template is gone
    # with the exec, and the box is one process fewer.
    _arrange([0, 1, 2, req_w, res_r, out_r, err_r, out_w, err_w])
    argv = ["kiln-agent"] + plan["agent_args"] + ["-adopt-kernel", str(k)]
    env = dict(kv.split("=", 1) for kv in plan["env"])
    os.execve(plan["agent"], argv, env)


def _reseed(plan):
    """Forked boxes share the template's random state: draw new seeds, as
    the host's one list says (sandbox.ReseedCode, in the plan)."""
    try:
        exec(plan.get("reseed") or "", {})
    except Exception:
        pass


def _spawn(plan, fds):
    """Make the box's first process, P cloned into the box's namespaces
    (_clone_box) or else G forked (_box), and write its id maps once it
    has its own user namespace. Returns True in the box's kernel only,
    False in the template."""
    global _SYS_CAPSET, _SYS_CAPGET, _SYS_CLONE
    _SYS_CAPSET, _SYS_CAPGET = plan.get("sys_capset", -1), plan.get("sys_capget", -1)
    _SYS_CLONE = plan.get("sys_clone", -1)
    a_r = a_w = b_r = b_w = -1
    cloned = False
    try:
        a_r, a_w = os.pipe()  # G (or P) to the template
        b_r, b_w = os.pipe()  # the template to G (or P)
        if _can_clone():
            pid, cloned = _clone_box(plan), True
        else:
            pid = os.fork()
    except (OSError, AttributeError) as e:
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
        (_box_cloned if cloned else _box)(plan, 3, 4)
        _reseed(plan)
        _rethread(plan)
        return True
    except BaseException as e:
        try:
            os.write(2, ("kiln zygote: %s: %s\n" % (type(e).__name__, e)).encode())
        except Exception:
            pass
        os._exit(1)


def _can_clone():
    """Whether the template can clone a box in one step: the host gave
    clone(2)'s number, this python exports its fork steps, and the
    template is one thread. A raw clone(2) runs none of the pthread_atfork
    handlers fork(3) runs, which libraries with threads of their own rely
    on (OpenBLAS stops its pool in them); the template's pools are stopped
    by _quiesce and stay so while it only forks."""
    if _SYS_CLONE <= 0:
        return False
    api = ctypes.pythonapi
    if not all(hasattr(api, f) for f in ("PyOS_BeforeFork", "PyOS_AfterFork_Child", "PyOS_AfterFork_Parent")):
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _clone(flags):
    """fork() with namespace flags, as os.fork does it: the interpreter's
    before- and after-fork steps (the import lock, the GIL, at-fork hooks
    such as random's reseed) around a raw clone(2), called with the GIL
    held. glibc's own at-fork handlers do not run, so the caller must be
    single-threaded; glibc's cached thread id stays the parent's in the
    child, which only its robust and error-checking mutexes read, and the
    child forks (fork(3) sets its children's) and execs."""
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _libc_gil.syscall(ctypes.c_long(_SYS_CLONE), ctypes.c_ulong(flags | SIGCHLD), ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_ulong(0))
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid == -1:
        raise OSError(err, "clone: %s" % os.strerror(err))
    return pid


def _clone_box(plan):
    """P in one step: a clone of the template that is PID 1 of the box's
    new pid namespace, in the box's new user namespace, which owns it.
    Where the two-step form copies the template's memory into G and G's
    into P, this copies it once; the box's K is the second copy. The user
    namespace must be owned by the box's host uid and P counted against
    it, so the template takes that uid as real and effective uid (gid
    alike) for the clone only (its capabilities stay: no uid is 0). P
    enters the box's other namespaces once the host has moved it into the
    box's cgroup (_box_cloned). What the kernel allocates for the user and
    pid namespaces and P's page tables is charged to the template's
    cgroup; K's are charged to the box's.
    Returns P's pid in the template, 0 in P."""
    host = plan["host_id"]
    ruid, euid, _ = os.getresuid()
    rgid, egid, _ = os.getresgid()
    os.setresgid(host, host, -1)
    try:
        os.setresuid(host, host, -1)
    except OSError:
        os.setresgid(rgid, egid, -1)
        raise
    pid = -1
    try:
        pid = _clone(CLONE_NEWUSER | CLONE_NEWPID)
    finally:
        if pid != 0:  # the template: its own ids again
            os.setresuid(ruid, euid, -1)
            os.setresgid(rgid, egid, -1)
    return pid


def _map(pid, plan, from_g, to_g):
    """Write the box's uid and gid maps once it has unshared its user
    namespace. The kernel wants the writer privileged in the parent
    namespace (our capabilities) and over the new one: its owner, the
    box's host uid, which we become as effective uid (and so file uid) for
    the writes only. The box itself may not write them."""
    import select

    ready, _, _ = select.select([from_g], [], [], 10)
    if not ready or os.read(from_g, 1) != b"u":
        return  # G died or hung; the host times out and destroys it
    me = os.geteuid()
    try:
        os.setresuid(-1, plan["host_id"], -1)
        for name, value in (("setgroups", "deny"), ("gid_map", plan["gid_map"]), ("uid_map", plan["uid_map"])):
            with open("/proc/%d/%s" % (pid, name), "w") as f:
                f.write(value)
        os.write(to_g, b"m")
    except OSError as e:
        try:
            os.write(2, ("kiln zygote: mapping the box's ids: %s\n" % e).encode())
        except OSError:
            pass
    finally:
        os.setresuid(-1, me, -1)


# Thread pools _quiesce stopped, by library: the size each had, for a box
# with the CPUs to use it (_rethread).
_POOLS = {}


def _quiesce():
    """Stop every thread pool the preloads started, so that the template
    is one thread and can clone boxes in one step (_clone_box). First the
    pools no at-fork handler stops: numexpr's (pandas imports it), cut to
    one thread, which numexpr runs in the calling thread. Then one fork
    whose child exits at once, to run the pthread_atfork handlers of the
    libraries the preloads loaded: OpenBLAS stops its thread pool in them
    and starts it again only when the template runs BLAS, which it never
    does. Returns the template's threads left over, by name (a pool kiln
    does not know of), which keep it to two steps."""
    ne = sys.modules.get("numexpr")
    if ne is not None:
        try:
            _POOLS["numexpr"] = ne.set_num_threads(1)
        except Exception:
            pass
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        # With SIGCHLD ignored this returns once the child is gone, when
        # no page is shared with it any more (_hugepages needs that).
        os.waitpid(pid, 0)
    except OSError:
        pass
    return _threads()


def _threads():
    """The names of this process's threads but the main one."""
    out = []
    try:
        for tid in sorted(os.listdir("/proc/self/task"), key=int)[1:]:
            try:
                with open("/proc/self/task/%s/comm" % tid) as f:
                    out.append(f.read().strip())
            except OSError:
                out.append("?")
    except OSError:
        pass
    return out


def _rethread(plan):
    """K: give back the pools _quiesce cut to one thread, as many threads
    as they had but no more than the box's CPUs; a one-CPU box (the
    default) keeps one and starts no thread."""
    cpus = -int(-float(plan.get("cpus") or 1) // 1)
    n = min(_POOLS.get("numexpr", 1), cpus)
    if n > 1:
        try:
            sys.modules["numexpr"].set_num_threads(n)
        except Exception:
            pass


MADV_COLLAPSE = 25
_HUGE = 2 << 20


def _hugepages():
    """Collapse the template's anonymous memory (the heap the preloads
    filled) into transparent huge pages where it spans whole 2 MiB
    blocks. Every box is a copy of the template: a fork copies one page
    table entry per huge page instead of 512, and an exit frees as few;
    a box that writes into a block splits only its own mapping of it and
    copies 4 KiB pages, as before. MADV_COLLAPSE leaves the mappings'
    flags alone, so a box's own allocations follow the host's THP setting.
    Best effort: kernels before 6.1 do not have it."""
    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:
        return
    for line in maps:
        f = line.split()
        if len(f) < 5 or f[1] != "rw-p" or (len(f) > 5 and f[5] != "[heap]"):
            continue
        lo, hi = (int(x, 16) for x in f[0].split("-"))
        lo, hi = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        if hi > lo:
            _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(MADV_COLLAPSE))


def zygote_main():
    global _CTL
    preloaded = prepare()
    _CTL = socket.socket(fileno=3)
    # Children of the template are reaped by the kernel; each box's
    # processes are reaped by its own PID 1.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    gc.collect()
    gc.freeze()  # keep the collector off the shared pages in every box
    threads = _quiesce()
    _hugepages()
    hello = {"ready": True, "python": sys.version.split()[0], "preloaded": preloaded, "threads": threads}
    _CTL.send(json.dumps(hello).encode())
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
