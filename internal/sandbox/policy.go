package sandbox

// The syscall policy every box's code runs under, as data, shared by the
// backends that filter syscalls: the jail loads it as a seccomp filter on
// the host kernel, gVisor as the OCI seccomp filter its own kernel applies.
// The hostile battery (sandboxtest) is the victim test that sees each
// class refused.

// DeniedSyscalls fail with EPERM in every box: they reach the kernel's
// riskiest surfaces or the host (tracing, mounts and namespaces, BPF, keys,
// modules, kexec, clocks, io_uring) and ordinary code has no need of them.
var DeniedSyscalls = []string{
	"ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
	"mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
	"open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
	"bpf", "perf_event_open", "userfaultfd",
	"keyctl", "add_key", "request_key",
	"init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
	"reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "vhangup",
	"settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
	"iopl", "ioperm", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
	"io_uring_setup", "io_uring_enter", "io_uring_register",
	"fanotify_init",
}

// Namespace flags of clone(2).
const (
	CloneNewNS     = 0x00020000
	CloneNewCgroup = 0x02000000
	CloneNewUTS    = 0x04000000
	CloneNewIPC    = 0x08000000
	CloneNewUser   = 0x10000000
	CloneNewPID    = 0x20000000
	CloneNewNet    = 0x40000000
)

// DeniedCloneFlags make clone(2) fail with EPERM when any one of them is set
// in its first argument: creating namespaces inside the box is refused.
var DeniedCloneFlags = []uint64{CloneNewNS, CloneNewCgroup, CloneNewUTS, CloneNewIPC, CloneNewUser, CloneNewPID, CloneNewNet}

// AbsentSyscalls fail with ENOSYS, as if the kernel were too old to have
// them. clone3 passes its flags in memory, out of a filter's reach, so it
// cannot be refused for namespace flags only; refusing it with EPERM would
// break threads, since libc falls back to clone(2) only on ENOSYS.
var AbsentSyscalls = []string{"clone3"}

// AFPacket sockets are refused by socket(2) (EPERM when its first argument
// is AF_PACKET). Raw IP sockets need CAP_NET_RAW, which no box holds; the
// victim test checks both.
const AFPacket = 17
