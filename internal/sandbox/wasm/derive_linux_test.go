package wasm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox/sandboxtest"
)

// TestDenoSyscallsDerived is where DenoSyscallPolicy comes from: it runs
// the wasm conformance suite (the snapshot's Deno and boxes' Deno, cold
// and restored, under every hostile case) under the policy, with every
// call the policy does not allow sent to the test as a seccomp user
// notification. A call the policy refuses is answered as the filter
// would; a call it does not decide is let through and makes the test
// fail, naming it: add it to DenoSyscalls (or DenoAbsentSyscalls, if
// Deno does without).
//
// It is a tool, not a gate: it runs the whole suite twice under user
// notification (over 40 minutes here), so it runs only when asked for with
// KILN_DERIVE_DENO_SYSCALLS=1, after a change of Deno or Pyodide.
func TestDenoSyscallsDerived(t *testing.T) {
	if os.Getenv("KILN_DERIVE_DENO_SYSCALLS") != "1" {
		t.Skip("derives the Deno syscall policy (over 40 minutes): set KILN_DERIVE_DENO_SYSCALLS=1 to run it")
	}
	if os.Geteuid() != 0 {
		t.Skip("taking a seccomp listener from a Deno process (pidfd_getfd) needs root")
	}
	info, err := arch.GetInfo("")
	if err != nil {
		t.Fatal(err)
	}
	d := &deriver{t: t, info: info, waiting: map[uint64]*os.File{}, undecided: map[string]int{}, refused: map[string]int{}, done: make(chan struct{})}
	go d.watch()
	defer d.stop()
	for _, cold := range []bool{false, true} {
		t.Run(fmt.Sprint("cold=", cold), func(t *testing.T) {
			b := newTestBackendWith(t, Options{Cold: cold})
			b.plat.seccompNotify = d.pipe
			sandboxtest.RunWith(t, b, conformance)
		})
	}
	d.stop()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.served == 0 {
		t.Fatal("no Deno process was watched")
	}
	t.Logf("watched %d Deno processes; refused as the policy says: %v", d.served, d.refused)
	if len(d.undecided) > 0 {
		t.Errorf("Deno called what DenoSyscallPolicy does not decide (calls): %v\nadd them to DenoSyscalls or DenoAbsentSyscalls", d.undecided)
	}
}

// deriver takes the seccomp listener of each Deno process it hands a
// pipe to, and answers its notifications.
type deriver struct {
	t    *testing.T
	info *arch.Info

	mu        sync.Mutex
	waiting   map[uint64]*os.File // pipe inode → the write end its init waits on
	undecided map[string]int
	refused   map[string]int
	served    int
	wg        sync.WaitGroup
	done      chan struct{}
	once      sync.Once
}

func (d *deriver) stop() {
	d.once.Do(func() { close(d.done) })
	d.wg.Wait()
}

// pipe is platform.seccompNotify.
func (d *deriver) pipe() *os.File {
	r, w, err := os.Pipe()
	if err != nil {
		d.t.Error(err)
		return nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(r.Fd()), &st); err != nil {
		d.t.Error(err)
	}
	d.mu.Lock()
	d.waiting[st.Ino] = w
	d.mu.Unlock()
	return r
}

// watch finds the inits holding the pipes, takes their listeners once
// they have loaded the filter, and lets them go on.
func (d *deriver) watch() {
	d.wg.Add(1)
	defer d.wg.Done()
	for {
		select {
		case <-d.done:
			return
		case <-time.After(2 * time.Millisecond):
		}
		d.mu.Lock()
		n := len(d.waiting)
		d.mu.Unlock()
		if n == 0 {
			continue
		}
		procs, _ := filepath.Glob("/proc/[0-9]*/fd")
		for _, fdDir := range procs {
			var pid int
			fmt.Sscanf(fdDir, "/proc/%d/fd", &pid)
			if pid == os.Getpid() {
				continue
			}
			ents, err := os.ReadDir(fdDir)
			if err != nil {
				continue
			}
			var ino uint64
			listener := -1
			for _, e := range ents {
				l, err := os.Readlink(fdDir + "/" + e.Name())
				if err != nil {
					continue
				}
				if _, err := fmt.Sscanf(l, "pipe:[%d]", &ino); err == nil {
					d.mu.Lock()
					_, ours := d.waiting[ino]
					d.mu.Unlock()
					if !ours {
						ino = 0
					}
				}
				if l == "anon_inode:seccomp notify" {
					fmt.Sscanf(e.Name(), "%d", &listener)
				}
			}
			if ino == 0 || listener < 0 {
				continue
			}
			if err := d.take(pid, listener, ino); err != nil {
				d.t.Errorf("taking the listener of %d: %v", pid, err)
			}
		}
	}
}

func (d *deriver) take(pid, fd int, ino uint64) error {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return err
	}
	defer unix.Close(pidfd)
	l, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return err
	}
	d.mu.Lock()
	w := d.waiting[ino]
	delete(d.waiting, ino)
	d.served++
	d.mu.Unlock()
	w.Write([]byte{1})
	w.Close()
	d.wg.Add(1)
	go d.serve(l)
	return nil
}

// seccompNotif and seccompNotifResp are struct seccomp_notif and
// seccomp_notif_resp (linux/seccomp.h).
type seccompNotif struct {
	ID    uint64
	PID   uint32
	Flags uint32
	Nr    int32
	Arch  uint32
	IP    uint64
	Args  [6]uint64
}

type seccompNotifResp struct {
	ID    uint64
	Val   int64
	Error int32
	Flags uint32
}

// serve answers one process's notifications until it is gone.
func (d *deriver) serve(l int) {
	defer d.wg.Done()
	defer unix.Close(l)
	for {
		pfd := []unix.PollFd{{Fd: int32(l), Events: unix.POLLIN}}
		n, err := unix.Poll(pfd, 50)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return
		}
		if n == 0 {
			select {
			case <-d.done:
				return
			default:
				continue
			}
		}
		if pfd[0].Revents&unix.POLLHUP != 0 && pfd[0].Revents&unix.POLLIN == 0 {
			return
		}
		var req seccompNotif
		if err := ioctl(l, unix.SECCOMP_IOCTL_NOTIF_RECV, unsafe.Pointer(&req)); err != nil {
			if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EINTR) {
				continue
			}
			return
		}
		name := d.info.SyscallNumbers[int(req.Nr)]
		if name == "" {
			name = fmt.Sprint("#", req.Nr)
		}
		resp := seccompNotifResp{ID: req.ID}
		action, decided := boxpolicy.PolicyAction(boxpolicy.DenoSyscallPolicy, name, req.Args[:])
		key := name
		if slices.Contains([]string{"ioctl", "prctl", "clone", "socket", "socketpair"}, name) {
			key = fmt.Sprintf("%s(%#x, %#x)", name, req.Args[0], req.Args[1])
		}
		d.mu.Lock()
		switch {
		case !decided:
			d.undecided[key]++
			resp.Flags = unix.SECCOMP_USER_NOTIF_FLAG_CONTINUE
		case action == boxpolicy.Deny:
			d.refused[key]++
			resp.Error = -int32(unix.EPERM)
		default:
			d.refused[key]++
			resp.Error = -int32(unix.ENOSYS)
		}
		d.mu.Unlock()
		ioctl(l, unix.SECCOMP_IOCTL_NOTIF_SEND, unsafe.Pointer(&resp))
	}
}

func ioctl(fd int, req uint, arg unsafe.Pointer) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(arg))
	if errno != 0 {
		return errno
	}
	return nil
}
