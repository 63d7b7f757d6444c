package boxpolicy

import "slices"

// The syscall policy every box's code runs under, as data, shared by the
// backends that filter syscalls: the jail assembles it into a seccomp
// program for the host kernel, gVisor gets it as the OCI seccomp section
// its own kernel applies. The hostile battery (sandboxtest) is the victim
// test that sees each class refused through every entry the CPU offers.
//
// It is an allowlist. SyscallPolicy is read in order and the first rule
// that matches a call decides; a call no rule matches fails with ENOSYS, as
// if the kernel were too old to have it, which is what libc and runtimes
// expect of a syscall they probe and then do without. Explicit refusals
// fail with EPERM. Only the native entry is served: an i386 (int 0x80) or
// x32-numbered call is never allowed, whatever its number (the jail kills
// the process for a foreign architecture and answers ENOSYS to x32
// numbers; gVisor implements neither).
//
// The list starts from the shape of the default profiles of Docker and
// containerd, without what they allow only to privileged containers and
// without what a box's code has no use for and what has been a rich source
// of kernel bugs (io_uring, userfaultfd, perf, BPF, keys, kernel AIO,
// NUMA policy, new mount API, namespaces), with argument filters on the
// calls that multiplex a large surface: socket families, clone flags,
// ioctl commands, prctl options and personalities.

// SyscallAction is what a rule does with a call it matches.
type SyscallAction int

const (
	// Allow runs the call.
	Allow SyscallAction = iota
	// Deny fails it with EPERM.
	Deny
	// Absent fails it with ENOSYS, as if the kernel did not have it: libc
	// falls back to an older call.
	Absent
)

func (a SyscallAction) String() string {
	switch a {
	case Allow:
		return "allow"
	case Deny:
		return "deny"
	case Absent:
		return "absent"
	}
	return "unknown"
}

// ArgCheck holds when argument Index of a call, masked with Mask, equals
// Value. The kernel reads int-typed arguments from the low 32 bits only, so
// checks on them mask with Low32: whatever a caller leaves in the high half
// of the register cannot make a refused value look different.
type ArgCheck struct {
	Index uint
	Mask  uint64
	Value uint64
}

// Masks for ArgCheck.
const (
	Low32 = 0xffffffff
	All64 = 0xffffffffffffffff
)

// SyscallRule applies Action to calls of Names whose arguments pass every
// check in Args (at most one check an argument: runsc reads several on one
// argument as alternatives).
type SyscallRule struct {
	Names  []string
	Action SyscallAction
	Args   []ArgCheck
}

// argIs is a rule for one call whose int argument index equals value.
func argIs(action SyscallAction, name string, index uint, value uint64) SyscallRule {
	return SyscallRule{Names: []string{name}, Action: action, Args: []ArgCheck{{Index: index, Mask: Low32, Value: value}}}
}

// Socket families and protocols (socket(2)).
const (
	AFUnix       = 1
	AFInet       = 2
	AFInet6      = 10
	AFNetlink    = 16
	AFPacket     = 17
	AFVsock      = 40
	NetlinkRoute = 0
)

// Namespace flags of clone(2) and unshare(2).
const (
	CloneNewNS     = 0x00020000
	CloneNewCgroup = 0x02000000
	CloneNewUTS    = 0x04000000
	CloneNewIPC    = 0x08000000
	CloneNewUser   = 0x10000000
	CloneNewPID    = 0x20000000
	CloneNewNet    = 0x40000000
)

// DeniedCloneFlags make clone(2) fail with EPERM when any one of them is
// set in its first argument: creating namespaces inside the box is refused.
var DeniedCloneFlags = []uint64{CloneNewNS, CloneNewCgroup, CloneNewUTS, CloneNewIPC, CloneNewUser, CloneNewPID, CloneNewNet}

// cloneNamespaces is DeniedCloneFlags as one mask.
const cloneNamespaces = CloneNewNS | CloneNewCgroup | CloneNewUTS | CloneNewIPC | CloneNewUser | CloneNewPID | CloneNewNet

// DeniedSyscalls fail with EPERM in every box: they reach the kernel's
// riskiest surfaces or the host (tracing and other processes' memory and
// files, mounts and namespaces, BPF, keys, modules, kexec, clocks,
// io_uring, userfaultfd, perf) and ordinary code has no need of them. They
// would fail with ENOSYS anyway, as no rule allows them; naming them says
// "refused" rather than "absent", and the policy test keeps them out of the
// allowlist.
var DeniedSyscalls = []string{
	"ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise",
	"mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
	"open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
	"bpf", "perf_event_open", "userfaultfd",
	"keyctl", "add_key", "request_key",
	"init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
	"reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "vhangup",
	"settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
	"iopl", "ioperm", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
	"io_uring_setup", "io_uring_enter", "io_uring_register",
	"fanotify_init", "modify_ldt",
}

// AbsentSyscalls fail with ENOSYS. clone3 passes its flags in memory, out
// of a filter's reach, so it cannot be refused for namespace flags only;
// refusing it with EPERM would break threads, since libc falls back to
// clone(2) only on ENOSYS.
var AbsentSyscalls = []string{"clone3"}

// hotSyscalls come first: a filter tests rules in order, and these are
// most of what a busy box calls.
var hotSyscalls = []string{
	"read", "write", "futex", "mmap", "munmap", "mprotect", "madvise", "brk",
	"close", "openat", "newfstatat", "fstat", "statx", "lseek", "getdents64",
	"rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack",
	"epoll_pwait", "epoll_wait", "epoll_ctl", "poll", "ppoll", "pselect6", "select",
	"nanosleep", "clock_nanosleep", "clock_gettime", "gettimeofday",
	"getpid", "gettid", "getppid", "sched_yield", "tgkill",
	"readv", "writev", "pread64", "pwrite64", "fcntl", "pipe2", "dup3", "wait4",
}

// AllowedSyscalls run unconditionally: what the agent (Go), python3 with
// numpy, pandas and matplotlib, bash and coreutils call. Names an
// architecture lacks are skipped by its filter.
var AllowedSyscalls = slices.Concat(hotSyscalls, []string{
	// Files and directories.
	"open", "openat2", "creat", "stat", "lstat", "access", "faccessat", "faccessat2",
	"readlink", "readlinkat", "getdents", "getcwd", "chdir", "fchdir", "umask",
	"mkdir", "mkdirat", "rmdir", "rename", "renameat", "renameat2",
	"link", "linkat", "symlink", "symlinkat", "unlink", "unlinkat",
	"mknod", "mknodat", "chmod", "fchmod", "fchmodat", "fchmodat2",
	"chown", "fchown", "lchown", "fchownat",
	"truncate", "ftruncate", "fallocate", "fadvise64", "readahead",
	"utime", "utimes", "utimensat", "futimesat",
	"statfs", "fstatfs", "flock", "fsync", "fdatasync", "sync", "syncfs", "sync_file_range",
	"getxattr", "lgetxattr", "fgetxattr", "getxattrat", "listxattr", "llistxattr", "flistxattr", "listxattrat",
	"setxattr", "lsetxattr", "fsetxattr", "setxattrat", "removexattr", "lremovexattr", "fremovexattr", "removexattrat",
	"preadv", "pwritev", "preadv2", "pwritev2",
	"sendfile", "splice", "tee", "vmsplice", "copy_file_range", "cachestat",
	"inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
	"close_range", "dup", "dup2", "pipe",
	"memfd_create",
	// Memory.
	"mremap", "msync", "mincore", "mlock", "mlock2", "munlock", "mlockall", "munlockall",
	"membarrier", "pkey_alloc", "pkey_free", "pkey_mprotect", "mseal", "map_shadow_stack",
	// Processes, threads and signals.
	"fork", "vfork", "execve", "execveat", "exit", "exit_group", "waitid",
	"set_tid_address", "set_robust_list", "get_robust_list", "rseq", "arch_prctl", "restart_syscall",
	"futex_waitv", "futex_wake", "futex_wait", "futex_requeue",
	"kill", "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "rt_sigpending", "rt_sigsuspend", "rt_sigtimedwait",
	"pause", "alarm", "signalfd", "signalfd4", "eventfd", "eventfd2",
	"pidfd_open", "pidfd_send_signal",
	"getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
	"setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid",
	"capget", "capset",
	"getpgid", "setpgid", "getpgrp", "getsid", "setsid",
	"getpriority", "setpriority", "getrlimit", "setrlimit", "prlimit64", "getrusage", "times",
	"sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_setparam",
	"sched_getscheduler", "sched_setscheduler", "sched_getattr", "sched_setattr",
	"sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
	"ioprio_get", "ioprio_set", "getcpu",
	"landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self", "seccomp",
	// Time.
	"time", "clock_getres", "getitimer", "setitimer",
	"timer_create", "timer_settime", "timer_gettime", "timer_getoverrun", "timer_delete",
	"timerfd_create", "timerfd_settime", "timerfd_gettime",
	// The system, read only.
	"uname", "sysinfo", "getrandom",
	// Sockets, whose families socket(2) restricts, and event loops.
	"bind", "connect", "listen", "accept", "accept4", "getsockname", "getpeername",
	"sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown",
	"getsockopt", "setsockopt",
	"epoll_create", "epoll_create1", "epoll_pwait2",
	// System V and POSIX IPC, inside the box's own IPC namespace.
	"shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
	"msgget", "msgsnd", "msgrcv", "msgctl",
	"mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
})

// Terminal ioctls a box may not issue: typing into a terminal's input
// (TIOCSTI), the virtual console's multiplexer (TIOCLINUX), console
// redirection, line disciplines, serial and hangup.
const (
	TIOCSTI     = 0x5412
	TIOCLINUX   = 0x541c
	TIOCCONS    = 0x541d
	TIOCSSERIAL = 0x541f
	TIOCSETD    = 0x5423
	TIOCVHANGUP = 0x5437
)

// DeniedIoctls fail with EPERM; every other ioctl command is the business
// of the file it is issued on.
var DeniedIoctls = []uint64{TIOCSTI, TIOCLINUX, TIOCCONS, TIOCSSERIAL, TIOCSETD, TIOCVHANGUP}

// AllowedPrctls are the prctl(2) options a box may use: its own name,
// death signal, dumpability (the agent makes itself non-dumpable), no_new_privs
// and seccomp state, child subreaper, timer slack, transparent huge pages,
// speculation controls, and names and protections of its own mappings.
var AllowedPrctls = []uint64{
	1, 2, // PR_SET_PDEATHSIG, PR_GET_PDEATHSIG
	3, 4, // PR_GET_DUMPABLE, PR_SET_DUMPABLE
	15, 16, // PR_SET_NAME, PR_GET_NAME
	21,     // PR_GET_SECCOMP
	23,     // PR_CAPBSET_READ
	29, 30, // PR_SET_TIMERSLACK, PR_GET_TIMERSLACK
	36, 37, // PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER
	38, 39, // PR_SET_NO_NEW_PRIVS, PR_GET_NO_NEW_PRIVS
	40,     // PR_GET_TID_ADDRESS
	41, 42, // PR_SET_THP_DISABLE, PR_GET_THP_DISABLE
	52,     // PR_GET_SPECULATION_CTRL
	65, 66, // PR_SET_MDWE, PR_GET_MDWE
	0x53564d41, // PR_SET_VMA (names anonymous mappings)
}

// AllowedPersonalities are the personality(2) values a box may set or
// query: the default, 32-bit uname, and the query itself. Never
// ADDR_NO_RANDOMIZE or READ_IMPLIES_EXEC.
var AllowedPersonalities = []uint64{0, 0x8, 0x20000, 0x20008, 0xffffffff}

// SyscallPolicy is the table both loaders read: first match wins, and a
// call nothing matches fails with ENOSYS.
var SyscallPolicy = slices.Concat(
	[]SyscallRule{
		{Names: AllowedSyscalls, Action: Allow},
		{Names: DeniedSyscalls, Action: Deny},
		{Names: AbsentSyscalls, Action: Absent},
		// clone(2) without any namespace flag; with one, EPERM.
		{Names: []string{"clone"}, Action: Allow, Args: []ArgCheck{{Index: 0, Mask: cloneNamespaces, Value: 0}}},
		{Names: []string{"clone"}, Action: Deny},
		// Sockets of the families a box's code and libc use: unix,
		// IPv4, IPv6, and netlink for routes only (getaddrinfo and
		// if_nameindex read the interfaces through it). Packet, vsock,
		// other netlink families, AF_ALG, Bluetooth, … are refused.
		argIs(Allow, "socket", 0, AFUnix),
		argIs(Allow, "socket", 0, AFInet),
		argIs(Allow, "socket", 0, AFInet6),
		{Names: []string{"socket"}, Action: Allow, Args: []ArgCheck{{Index: 0, Mask: Low32, Value: AFNetlink}, {Index: 2, Mask: Low32, Value: NetlinkRoute}}},
		{Names: []string{"socket"}, Action: Deny},
		argIs(Allow, "socketpair", 0, AFUnix),
		{Names: []string{"socketpair"}, Action: Deny},
	},
	ruleEach(Deny, "ioctl", 1, DeniedIoctls),
	[]SyscallRule{{Names: []string{"ioctl"}, Action: Allow}},
	ruleEach(Allow, "prctl", 0, AllowedPrctls),
	[]SyscallRule{{Names: []string{"prctl"}, Action: Deny}},
	ruleEach(Allow, "personality", 0, AllowedPersonalities),
	[]SyscallRule{{Names: []string{"personality"}, Action: Deny}},
)

// PolicyAction reads policy as the loaders must: the action of the first
// rule that names the call and whose checks all hold on args (missing
// arguments are 0); false when none does (the call is absent).
func PolicyAction(policy []SyscallRule, name string, args []uint64) (SyscallAction, bool) {
	for _, r := range policy {
		if !slices.Contains(r.Names, name) {
			continue
		}
		ok := true
		for _, c := range r.Args {
			var a uint64
			if int(c.Index) < len(args) {
				a = args[c.Index]
			}
			ok = ok && a&c.Mask == c.Value
		}
		if ok {
			return r.Action, true
		}
	}
	return 0, false
}

// ruleEach is one rule a value: action for name when its int argument
// index equals the value.
func ruleEach(action SyscallAction, name string, index uint, values []uint64) []SyscallRule {
	var out []SyscallRule
	for _, v := range values {
		out = append(out, argIs(action, name, index, v))
	}
	return out
}

// DenoSyscalls are what Deno (V8 with its JIT, tokio, Pyodide's
// WebAssembly) calls while it runs a wasm box, and nothing else: the
// wasm backend's confined Deno runs under DenoSyscallPolicy, and
// TestDenoSyscallsDerived (internal/sandbox/wasm) runs boxes under it with
// every call the policy does not decide reported to the test, which fails
// naming them. The list is derived from those runs, not from a guess.
var DenoSyscalls = []string{
	// Its own memory: V8's heaps and its JIT (PROT_EXEC mappings),
	// WebAssembly memory growing, memory protection keys.
	"mmap", "munmap", "mprotect", "madvise", "mremap", "brk", "pkey_alloc",
	// Threads and their event loops.
	"futex", "sched_yield", "sched_getaffinity", "sched_getparam", "sched_getscheduler",
	"epoll_create1", "epoll_ctl", "epoll_wait", "poll", "eventfd2", "recvfrom",
	"clock_nanosleep",
	"rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack",
	"arch_prctl", "set_tid_address", "set_robust_list", "rseq",
	"gettid", "getpid", "getppid", "getuid", "getrandom", "prlimit64", "sysinfo", "uname",
	// Files, inside its read-only root (Deno's permissions decide which
	// it may open): stdio, the runtime, its caches' failed creation.
	"read", "write", "pread64", "lseek", "close", "fcntl",
	"openat", "newfstatat", "fstat", "statx", "lstat", "access", "readlink", "getcwd", "getdents64",
	"mkdir", "unlink",
	"exit", "exit_group", "execve",
}

// DenoAbsentSyscalls are calls Deno probes and does without: ENOSYS, as
// if the kernel lacked them.
var DenoAbsentSyscalls = []string{"clone3"}

// DenoSyscallPolicy is the filter of the wasm backend's Deno processes,
// which kiln runs on the host (the box is inside them): first match wins,
// and a call nothing matches fails with ENOSYS. It has no sockets at all
// (the process has no network either), and creates no namespace.
var DenoSyscallPolicy = slices.Concat(
	[]SyscallRule{
		{Names: DenoSyscalls, Action: Allow},
		{Names: DeniedSyscalls, Action: Deny},
		{Names: DenoAbsentSyscalls, Action: Absent},
		{Names: []string{"clone"}, Action: Allow, Args: []ArgCheck{{Index: 0, Mask: cloneNamespaces, Value: 0}}},
		{Names: []string{"clone"}, Action: Deny},
		// tokio's signal driver wakes itself through a unix
		// socketpair; no other socket.
		argIs(Allow, "socketpair", 0, AFUnix),
		{Names: []string{"socket", "socketpair"}, Action: Deny},
	},
	ruleEach(Deny, "ioctl", 1, DeniedIoctls),
	[]SyscallRule{{Names: []string{"ioctl"}, Action: Allow}},
	ruleEach(Allow, "prctl", 0, AllowedPrctls),
	[]SyscallRule{{Names: []string{"prctl"}, Action: Deny}},
)
