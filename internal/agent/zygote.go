package agent

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"syscall"

	"kiln/internal/kernel"
)

// A jail zygote is a python3 that imported the preloaded modules once and
// forks a kernel for every new box (internal/kernel/zygote.py). The agent
// takes part twice: ExecZygote becomes the template, so the template's
// environment is exactly a kernel's; and in each box the agent adopts the
// kernel the zygote forked for it (Config.Adopt) instead of starting one.

// ExecZygote replaces the agent with the zygote's python3. The fork
// server's control socket must be on fd 3.
func ExecZygote(cfg Config) error {
	if cfg.Python == "" {
		return fmt.Errorf("a zygote needs python")
	}
	env := append(childEnv(&cfg),
		"KILN_DRIVER="+kernel.Driver,
		"KILN_PRELOAD="+strings.Join(cfg.Preload, ","),
		"KILN_ZYGOTE="+kernel.Zygote)
	argv := []string{cfg.Python, "-u", "-c", kernel.Bootstrap}
	return fmt.Errorf("executing zygote: %w", syscall.Exec(cfg.Python, argv, env))
}

// Adopted is a kernel the agent did not start: its pid (a child of the
// box's PID 1, which became this agent after forking it) and the agent's
// ends of its pipes.
type Adopted struct {
	Pid                int
	Req, Res, Out, Err *os.File
	// OutW and ErrW are write ends of the kernel's stdout and stderr
	// pipes, for the agent's own markers (see pyKernel.run).
	OutW, ErrW *os.File
}

// AdoptedFiles are the descriptors, in order, at which an adopted
// kernel's pipes reach the agent: 3 (requests), 4 (results), 5 (stdout),
// 6 (stderr), 7 and 8 (write ends of its stdout and stderr). They arrive
// inheritable; AdoptedFiles makes them close-on-exec, so no shell command
// or kernel the agent starts gets one.
func AdoptedFiles() []*os.File {
	names := []string{"kernel-req", "kernel-res", "kernel-out", "kernel-err", "kernel-out-w", "kernel-err-w"}
	files := make([]*os.File, len(names))
	for i, name := range names {
		syscall.CloseOnExec(3 + i)
		files[i] = os.NewFile(uintptr(3+i), name)
	}
	return files
}

// NewAdopted names the files of AdoptedFiles.
func NewAdopted(pid int, f []*os.File) *Adopted {
	return &Adopted{Pid: pid, Req: f[0], Res: f[1], Out: f[2], Err: f[3], OutW: f[4], ErrW: f[5]}
}

// adoptKernel wraps an adopted kernel and waits for its hello.
func adoptKernel(a *Adopted) (*pyKernel, error) {
	proc, err := os.FindProcess(a.Pid)
	if err != nil {
		return nil, fmt.Errorf("finding the adopted kernel: %w", err)
	}
	k := &pyKernel{
		proc: proc,
		req:  a.Req, resFile: a.Res, res: bufio.NewReaderSize(a.Res, 1<<16),
		out: newDemux(), errs: newDemux(), exited: make(chan struct{}),
		outW: a.OutW, errW: a.ErrW,
	}
	go k.pump(a.Out, k.out)
	go k.pump(a.Err, k.errs)
	go func() {
		// The agent is the kernel's parent: the box's PID 1 forked it and
		// then became the agent.
		if ps, err := proc.Wait(); err == nil {
			if ws, ok := ps.Sys().(syscall.WaitStatus); ok {
				k.adoptedStatus = &ws
			}
		} else {
			waitExit(a.Pid) // not our child (an agent started by hand on a pid)
		}
		kids.done(a.Pid)
		close(k.exited)
	}()
	if err := k.waitReady(); err != nil {
		return nil, err
	}
	return k, nil
}
