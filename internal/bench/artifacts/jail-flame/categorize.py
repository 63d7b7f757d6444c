#!/usr/bin/env python3
import sys, collections
rules = [
 ("fork: copy mm (dup_mmap)", ["dup_mmap"]),
 ("fork: other copy_process", ["copy_process"]),
 ("exec", ["begin_new_exec", "load_elf_binary", "bprm_execve"]),
 ("exit: mm teardown", ["exit_mmap"]),
 ("exit: other", ["do_exit"]),
 ("page faults", ["asm_exc_page_fault", "exc_page_fault"]),
 ("unshare/namespaces", ["ksys_unshare", "create_new_namespaces", "copy_namespaces"]),
 ("mount syscalls", ["__x64_sys_mount", "path_mount", "__x64_sys_umount", "__x64_sys_pivot_root", "__x64_sys_move_mount", "__x64_sys_open_tree"]),
 ("munmap/madvise/mmap", ["__x64_sys_munmap", "__x64_sys_madvise", "__x64_sys_mmap", "__x64_sys_mprotect"]),
 ("cgroup fs writes", ["cgroup_file_write", "kernfs_fop_write_iter"]),
 ("proc/sysfs open/read", ["proc_reg_read_iter", "seq_read_iter"]),
 ("seccomp", ["__seccomp_filter", "__x64_sys_seccomp"]),
 ("open/stat syscalls", ["do_sys_openat2", "vfs_statx", "__x64_sys_newfstatat", "__x64_sys_statx"]),
 ("sched/switch", ["finish_task_switch.isra.0", "__schedule", "schedule"]),
 ("other syscalls", ["do_syscall_64"]),
 ("other kernel (irq etc)", ["[kernel]"]),
]
def is_kernel(f):
    return not f.startswith("[") and "/" not in f
bycat = collections.Counter(); bycomm = collections.Counter(); cc = collections.Counter()
total = 0
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1); n = int(n)
    fr = stack.split(";"); comm = fr[0]; fs = set(fr[1:])
    total += n
    cat = None
    for name, keys in rules:
        if any(k in fs for k in keys): cat = name; break
    if cat is None:
        cat = "user: " + comm
    bycat[cat] += n; cc[(comm, cat)] += n
for k, v in bycat.most_common(): print("%5.1f%%  %s" % (100*v/total, k))
print("--- by comm, category")
for (c,k), v in cc.most_common(25): print("%5.1f%%  %-12s %s" % (100*v/total, c, k))
