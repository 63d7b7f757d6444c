// Command kiln-agent is the first process of every kiln sandbox. It speaks
// the agent protocol with the host on stdin/stdout (or, in a microVM guest,
// on a virtio-serial port), runs code and serves files. It is built static
// (CGO_ENABLED=0) and imports no host-side code.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"kiln/internal/agent"
	"kiln/internal/boxpolicy"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == agent.ExecCodeArg {
		// The agent starting code (agent.CodeSetup); never returns on success.
		err := agent.ExecCode(os.Args[2:])
		fmt.Fprintln(os.Stderr, "kiln-agent:", err)
		os.Exit(127)
	}
	var (
		workspace = flag.String("workspace", boxpolicy.Workspace, "workspace directory")
		python    = flag.String("python", "/usr/bin/python3", "python3 for the kernel; empty for none")
		preload   = flag.String("preload", "numpy,pandas,matplotlib", "comma-separated modules to import before the first call")
		uid       = flag.Int("uid", -1, "run code as this uid when the agent runs as root")
		gid       = flag.Int("gid", -1, "run code as this gid when the agent runs as root")
		guest     = flag.Bool("guest", false, "prepare a microVM guest (mounts, serial port) as PID 1")
		zygote    = flag.Bool("zygote", false, "become a jail zygote's python template (control socket on fd 3)")
		adopt     = flag.Int("adopt-kernel", 0, "use the kernel with this pid, forked by a jail zygote, whose pipes are on fds 3-9")
		await     = flag.Bool("await-host", false, "read one byte from the stream before saying hello (a host that attaches after the start, as on Kubernetes)")
		rlimits   = flag.String("code-rlimits", "", "set these rlimits on every process of code, as NAME=VALUE[,...] (RLIMIT_NPROC=64,RLIMIT_NOFILE=1024)")
		oomAdj    = flag.Int("code-oom-score-adj", 0, "set this oom_score_adj on every process of code (1000: code dies first); 0 leaves it")
		verbose   = flag.Bool("v", false, "debug logging on stderr")
	)
	flag.Parse()
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	var mods []string
	for _, m := range strings.Split(*preload, ",") {
		if m = strings.TrimSpace(m); m != "" {
			mods = append(mods, m)
		}
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	rl, err := agent.ParseRlimits(*rlimits)
	if err != nil {
		logger.Error("bad -code-rlimits", "err", err)
		os.Exit(2)
	}
	os.Exit(agent.Run(agent.Mode{
		Config: agent.Config{
			Workspace: *workspace,
			Python:    *python,
			Preload:   mods,
			UID:       *uid,
			GID:       *gid,
			Code:      agent.CodeSetup{Rlimits: rl, OOMScoreAdj: *oomAdj},
			Logger:    logger,
		},
		Guest:       *guest,
		Zygote:      *zygote,
		AdoptKernel: *adopt,
		AwaitHost:   *await,
	}))
}
