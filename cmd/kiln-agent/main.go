// Command kiln-agent is the first process of every kiln sandbox. It speaks
// the agent protocol with the host on stdin/stdout (or, in a microVM guest,
// on a virtio-serial port), runs code and serves files. It is built static
// (CGO_ENABLED=0) and imports no host-side code.
package main

import (
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"kiln/internal/agent"
	"kiln/internal/guestinit"
)

func main() {
	var (
		workspace = flag.String("workspace", "/work", "workspace directory")
		python    = flag.String("python", "/usr/bin/python3", "python3 for the kernel; empty for none")
		preload   = flag.String("preload", "numpy,pandas,matplotlib", "comma-separated modules to import before the first call")
		uid       = flag.Int("uid", -1, "run code as this uid when the agent runs as root")
		gid       = flag.Int("gid", -1, "run code as this gid when the agent runs as root")
		guest     = flag.Bool("guest", false, "prepare a microVM guest (mounts, serial port) as PID 1")
		zygote    = flag.Bool("zygote", false, "become a jail zygote's python template (control socket on fd 3)")
		adopt     = flag.Int("adopt-kernel", 0, "use the kernel with this pid, forked by a jail zygote, whose pipes are on fds 3-6")
		verbose   = flag.Bool("v", false, "debug logging on stderr")
	)
	flag.Parse()
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	var mods []string
	for _, m := range strings.Split(*preload, ",") {
		if m = strings.TrimSpace(m); m != "" {
			mods = append(mods, m)
		}
	}
	if *zygote {
		err := agent.ExecZygote(agent.Config{Workspace: *workspace, Python: *python, Preload: mods, UID: -1, GID: -1})
		fmt.Fprintln(os.Stderr, "kiln-agent:", err)
		os.Exit(1)
	}
	var adopted []*os.File
	if *adopt > 0 {
		adopted = agent.AdoptedFiles()
	}

	streamPath := ""
	if *guest && os.Getenv(agent.ChildEnv) == "" {
		p, err := guestinit.Setup(guestinit.Config{Workspace: *workspace})
		if err != nil {
			log.Error("preparing guest", "err", err)
			os.Exit(1)
		}
		streamPath = p
	}
	if os.Getpid() == 1 {
		// PID 1 only reaps; a child does the work, so exec.Cmd.Wait never
		// races the reaper for its own children's statuses.
		code := agent.ReapWith(streamPath, adopted)
		if *guest {
			guestinit.PowerOff()
		}
		os.Exit(code)
	}

	var r io.Reader = os.Stdin
	var w io.Writer = os.Stdout
	if p := os.Getenv(agent.StreamEnv); p != "" {
		f, err := os.OpenFile(p, os.O_RDWR, 0)
		if err != nil {
			log.Error("opening stream", "path", p, "err", err)
			os.Exit(1)
		}
		r, w = f, f
	}
	var kernel *agent.Adopted
	if *adopt > 0 {
		kernel = &agent.Adopted{Pid: *adopt, Req: adopted[0], Res: adopted[1], Out: adopted[2], Err: adopted[3], Status: adopted[4]}
	}
	codeCgroup := ""
	if *guest {
		codeCgroup = guestinit.CodeCgroup // the guest's memory and pids limits for code
	}
	a := agent.New(agent.Config{
		Cgroup:    codeCgroup,
		Workspace: *workspace,
		Python:    *python,
		Preload:   mods,
		UID:       *uid,
		GID:       *gid,
		Adopt:     kernel,
		Logger:    log,
	})
	if err := a.Serve(r, w); err != nil {
		fmt.Fprintln(os.Stderr, "kiln-agent:", err)
		os.Exit(1)
	}
}
